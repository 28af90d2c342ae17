"""What the router knows about its workers: one frozen `WorkerView` per worker, in a `PoolSnapshot`.

`WorkerPool` (pool.py) builds snapshots from the registry and its Info probes; `choice.py` and
the request flow read them. Load figures already include the router's own dispatches since the
last successful probe, so a burst of requests spreads out before the next probe lands.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from dsv4.types import WorkerRole


class WorkerHealth(enum.Enum):
    """Routing state of one worker, as the router's probes see it."""

    UNKNOWN = "unknown"  # listed by discovery, has not answered Info yet: not routable
    HEALTHY = "healthy"  # answered the last probe (or has failed fewer than N in a row)
    DRAINING = "draining"  # answers, but takes nothing new (Drain was called)
    DOWN = "down"  # failed N consecutive probes; routable again once it answers


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker. `address` is the key (one channel per address); `worker_id` is what the
    worker calls itself in Info (the registry's id until it has answered)."""

    address: str
    worker_id: str
    role: WorkerRole
    health: WorkerHealth
    layout_hash: str = ""
    block_size_tokens: int = 0
    num_free_blocks: int = 0
    num_queued_tokens: int = 0  # prefill: prompt tokens waiting; decode: remaining tokens
    num_running_requests: int = 0
    model_name: str = ""
    vocab_size: int = 0  # 0: never answered Info
    max_model_len: int = 0
    num_consecutive_failures: int = 0
    speculative_method: str = ""  # as the worker reports it ("" : not reported)

    @property
    def is_routable(self) -> bool:
        return self.health is WorkerHealth.HEALTHY

    @property
    def is_suspect(self) -> bool:
        """Routable, but its last probe failed: chosen only when no worker that answered is."""
        return self.is_routable and self.num_consecutive_failures > 0

    @property
    def has_reported(self) -> bool:
        """True once Info answered at least once (the model facts are known)."""
        return self.vocab_size > 0


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """The served model's limits, from the workers' Info answers."""

    model_name: str
    vocab_size: int
    max_model_len: int
    # What the workers that decode (decode and colocated) run: "mtp", "none", or "mtp,none"
    # while a rollout mixes them; "unknown" when none of them reports it.
    speculative_method: str = "unknown"


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """All known workers at one moment, sorted by address."""

    workers: tuple[WorkerView, ...] = ()
    is_registry_stale: bool = False  # discovery could not be reached: last known list

    def with_role(self, role: WorkerRole) -> tuple[WorkerView, ...]:
        return tuple(w for w in self.workers if w.role is role)

    def routable(self, role: WorkerRole) -> tuple[WorkerView, ...]:
        return tuple(w for w in self.workers if w.role is role and w.is_routable)

    def find(self, address: str) -> WorkerView | None:
        return next((w for w in self.workers if w.address == address), None)

    @property
    def has_route(self) -> bool:
        """True when some request could be served (readiness)."""
        decodes = self.routable(WorkerRole.DECODE)
        prefill_hashes = {w.layout_hash for w in self.routable(WorkerRole.PREFILL)}
        has_pair = any(d.layout_hash in prefill_hashes for d in decodes)
        return has_pair or bool(self.routable(WorkerRole.COLOCATED))

    def model_facts(self) -> ModelFacts | None:
        """Limits every request must respect: the smallest vocabulary and context among routable
        workers (falling back to any worker that ever answered); None when nobody has."""
        reported = [w for w in self.workers if w.is_routable and w.has_reported]
        reported = reported or [w for w in self.workers if w.has_reported]
        if not reported:
            return None
        methods = {
            w.speculative_method
            for w in reported
            if w.role is not WorkerRole.PREFILL and w.speculative_method
        }
        return ModelFacts(
            speculative_method=",".join(sorted(methods)) or "unknown",
            model_name=reported[0].model_name,
            vocab_size=min(w.vocab_size for w in reported),
            max_model_len=min(w.max_model_len for w in reported if w.max_model_len > 0)
            if any(w.max_model_len > 0 for w in reported)
            else 0,
        )


def describe_pool(workers: Iterable[WorkerView], name: str) -> str:
    """'prefill: 1 healthy of 3 (1 down, 1 unknown)' for error messages and logs."""
    workers = list(workers)
    healthy = sum(w.is_routable for w in workers)
    others = {}
    for w in workers:
        if not w.is_routable:
            others[w.health.value] = others.get(w.health.value, 0) + 1
    detail = ", ".join(f"{n} {state}" for state, n in sorted(others.items()))
    text = f"{name}: {healthy} healthy of {len(workers)}"
    return f"{text} ({detail})" if detail else text
