"""Choosing a prefill worker P and a decode worker D: pure functions over a `PoolSnapshot`.

Called by the request flow on the event loop, once per attempt. Rules:
- P: least queued prefill tokens; ties: fewest running requests, then address (stable).
  Draining, down and unknown workers are skipped, and so are the `exclude_*` addresses (those
  that failed earlier attempts of the same request).
- D: most free KV blocks among routable decode workers whose layout hash equals P's; ties:
  fewest running, then address. When the least-loaded P has no compatible D, the next P is
  tried, so one odd P does not block the pool.
- Colocated workers (one engine doing both) serve only when no disaggregated pair exists, e.g.
  a deployment without a prefill pool; the router then sends Decode without a handle.
- A worker that failed its last probe (still HEALTHY until it fails `num_failures_to_down` in a
  row, so one slow Info does not fail its streams) comes after every worker that answered: a
  crashed worker gets no new requests in the seconds before it is marked DOWN unless it is the
  only choice.
- No route: `Unavailable`, whose message says which pools are empty, down or incompatible.
"""

from __future__ import annotations

from collections.abc import Iterable, Set
from dataclasses import dataclass

from dsv4.errors import Unavailable
from dsv4.types import WorkerRole
from router_svc.view import PoolSnapshot, WorkerView, describe_pool


@dataclass(frozen=True, slots=True)
class Route:
    """Where one attempt of a request goes. `prefill` is None for a colocated worker."""

    prefill: WorkerView | None
    decode: WorkerView

    @property
    def is_colocated(self) -> bool:
        return self.prefill is None


def _prefill_order(w: WorkerView) -> tuple[bool, int, int, str]:
    return (w.is_suspect, w.num_queued_tokens, w.num_running_requests, w.address)


def _decode_order(w: WorkerView) -> tuple[bool, int, int, str]:
    return (w.is_suspect, -w.num_free_blocks, w.num_running_requests, w.address)


def _colocated_order(w: WorkerView) -> tuple[bool, int, int, int, str]:
    return (w.is_suspect, w.num_queued_tokens, w.num_running_requests, -w.num_free_blocks,
            w.address)  # fmt: skip


def _usable(workers: Iterable[WorkerView], exclude: Set[str]) -> list[WorkerView]:
    return [w for w in workers if w.is_routable and w.address not in exclude]


def choose_prefill(
    workers: Iterable[WorkerView], exclude: Set[str] = frozenset()
) -> WorkerView | None:
    """The least-loaded routable prefill worker not in `exclude`, or None."""
    candidates = _usable(workers, exclude)
    return min(candidates, key=_prefill_order) if candidates else None


def choose_decode(
    workers: Iterable[WorkerView], layout_hash: str, exclude: Set[str] = frozenset()
) -> WorkerView | None:
    """The routable decode worker with the most free blocks and this layout hash, or None."""
    candidates = [w for w in _usable(workers, exclude) if w.layout_hash == layout_hash]
    return min(candidates, key=_decode_order) if candidates else None


def choose_colocated(
    workers: Iterable[WorkerView], exclude: Set[str] = frozenset()
) -> WorkerView | None:
    """The least-loaded routable colocated worker not in `exclude`, or None."""
    candidates = _usable(workers, exclude)
    return min(candidates, key=_colocated_order) if candidates else None


def choose_route(
    snapshot: PoolSnapshot,
    *,
    exclude_prefill: Set[str] = frozenset(),
    exclude_decode: Set[str] = frozenset(),
) -> Route:
    """The (P, D) pair for the next attempt, or a colocated worker; raises Unavailable."""
    prefills = sorted(
        _usable(snapshot.with_role(WorkerRole.PREFILL), exclude_prefill), key=_prefill_order
    )
    decodes = snapshot.with_role(WorkerRole.DECODE)
    for prefill in prefills:
        decode = choose_decode(decodes, prefill.layout_hash, exclude_decode)
        if decode is not None:
            return Route(prefill=prefill, decode=decode)
    colocated = choose_colocated(snapshot.with_role(WorkerRole.COLOCATED), exclude_decode)
    if colocated is not None:
        return Route(prefill=None, decode=colocated)
    raise Unavailable(explain_no_route(snapshot, exclude_prefill, exclude_decode))


def explain_no_route(
    snapshot: PoolSnapshot, exclude_prefill: Set[str], exclude_decode: Set[str]
) -> str:
    """Why `choose_route` found nothing, in words an operator can act on."""
    pools = [
        describe_pool(snapshot.with_role(WorkerRole.PREFILL), "prefill pool"),
        describe_pool(snapshot.with_role(WorkerRole.DECODE), "decode pool"),
    ]
    if snapshot.with_role(WorkerRole.COLOCATED):
        pools.append(describe_pool(snapshot.with_role(WorkerRole.COLOCATED), "colocated"))
    reason = "no healthy worker can take this request"
    prefills = _usable(snapshot.with_role(WorkerRole.PREFILL), exclude_prefill)
    decodes = _usable(snapshot.with_role(WorkerRole.DECODE), exclude_decode)
    if prefills and decodes:
        p_hashes = sorted({w.layout_hash for w in prefills})
        d_hashes = sorted({w.layout_hash for w in decodes})
        reason = (
            f"prefill and decode workers are incompatible: prefill layout hashes {p_hashes}, "
            f"decode layout hashes {d_hashes}; run P and D with the same model and cache config"
        )
    elif not prefills and not decodes:
        reason = "both pools are empty or down"
    elif not prefills:
        reason = "the prefill pool is empty or down (and no colocated worker can stand in)"
    else:
        reason = "the decode pool is empty or down"
    tried = len(exclude_prefill) + len(exclude_decode)
    suffix = f"; {tried} worker(s) already failed this request" if tried else ""
    stale = (
        "; discovery is unreachable, this is the last known list"
        if snapshot.is_registry_stale
        else ""
    )
    return f"{reason} ({'; '.join(pools)}{suffix}{stale}); retry once workers are up"
