"""The `WorkerRegistry` contract: workers publish who they are and how loaded; the router lists them.

Reading path: `WorkerRecord` (one worker, as stored), `PoolView` (what a reader gets, with a
staleness flag), `WorkerRegistry`, then `WorkerHeartbeat` (the thread that keeps a worker's record
fresh). Implementations: `redis.py` (TTL heartbeats) and `static.py` (fixed address lists).
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from dsv4.errors import Dsv4Error, InvalidRequest

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class WorkerRecord:
    """One worker as the registry stores it. `transport_endpoint` is
    `TransportEndpoint.to_bytes()`; `updated_at` is unix seconds, set by the publisher."""

    role: str  # "prefill" | "decode"
    worker_id: str
    address: str  # host:port of the worker's gRPC server
    transport_kind: str = ""
    transport_endpoint: bytes = b""
    layout_hash: str = ""
    free_blocks: int = 0
    queued_prefill_tokens: int = 0
    running_requests: int = 0
    draining: bool = False
    updated_at: float = 0.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidRequest(f"worker role {self.role!r} must be one of {ROLES}")
        if not self.worker_id or not self.address:
            raise InvalidRequest(f"worker record needs a worker_id and an address: {self!r}")

    def to_fields(self) -> dict[str, str]:
        """Flat string fields (a Redis hash)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["transport_endpoint"] = base64.b64encode(self.transport_endpoint).decode()
        fields["draining"] = "1" if self.draining else "0"
        return {name: str(value) for name, value in fields.items()}

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> WorkerRecord:
        try:
            return cls(
                role=fields["role"],
                worker_id=fields["worker_id"],
                address=fields["address"],
                transport_kind=fields.get("transport_kind", ""),
                transport_endpoint=base64.b64decode(fields.get("transport_endpoint", "")),
                layout_hash=fields.get("layout_hash", ""),
                free_blocks=int(fields.get("free_blocks", 0)),
                queued_prefill_tokens=int(fields.get("queued_prefill_tokens", 0)),
                running_requests=int(fields.get("running_requests", 0)),
                draining=fields.get("draining") == "1",
                updated_at=float(fields.get("updated_at", 0.0)),
            )
        except (KeyError, ValueError) as exc:
            raise InvalidRequest(f"malformed worker record {fields!r}: {exc}") from exc


@dataclass(frozen=True)
class PoolView:
    """Workers of one role as last read. `is_stale` means the registry could not be reached and
    this is the last known view (from `fetched_at`, unix seconds)."""

    role: str
    workers: tuple[WorkerRecord, ...]
    is_stale: bool = False
    fetched_at: float = 0.0


@runtime_checkable
class WorkerRegistry(Protocol):
    def publish(self, record: WorkerRecord) -> None:
        """Worker side, from its `WorkerHeartbeat` thread (every `interval_s`) and on a state
        change (drain): store the record. Raises `Unavailable` when the registry is unreachable;
        the heartbeat logs it and retries."""

    def withdraw(self, worker_id: str) -> None:
        """Worker side, at shutdown after draining: remove the record now (do not wait for
        the TTL). Raises `Unavailable` when unreachable (the TTL then removes it)."""

    def list(self, role: str, *, include_draining: bool = False) -> PoolView:
        """Router side, any thread, per routing decision: the live workers of `role` (draining
        ones excluded unless asked). Served from a cache refreshed at most every
        `refresh_interval_s`; never raises for an unreachable registry, returns the last view
        marked stale instead."""

    def refresh(self) -> bool:
        """Router side (its watcher loop or tests): re-read the registry now. Returns False if
        it could not be reached (the cached views are then marked stale)."""

    def close(self) -> None:
        """Release connections. Idempotent."""


class WorkerHeartbeat:
    """Owns the thread that publishes `make_record()` every `interval_s` until `stop()`.

    `make_record` is called on the heartbeat thread and must be cheap and thread-safe (it reads
    the worker's load counters). Publish failures are logged once per outage, then retried with
    the same interval; an exception from `make_record` is logged and the loop keeps going.
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        make_record: Callable[[], WorkerRecord],
        interval_s: float = 1.0,
    ) -> None:
        self._registry = registry
        self._make_record = make_record
        self._interval_s = interval_s
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._is_failing = False
        self.num_published = 0

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("heartbeat already started")
        self._thread = threading.Thread(target=self._run, name="worker-heartbeat", daemon=True)
        self._thread.start()

    def beat(self) -> bool:
        """Publish once now (also used for a prompt update after a state change)."""
        try:
            record = dataclasses.replace(self._make_record(), updated_at=time.time())
            self._registry.publish(record)
        except Dsv4Error as exc:
            if not self._is_failing:
                logger.warning(
                    "heartbeat: cannot publish (%s); retrying every %.1f s", exc, self._interval_s
                )
            self._is_failing = True
            return False
        except Exception:
            logger.exception("heartbeat: building or publishing the record failed")
            return False
        if self._is_failing:
            logger.info("heartbeat: publishing again")
        self._is_failing = False
        self.num_published += 1
        return True

    def stop(self, *, withdraw: bool = False, worker_id: str | None = None) -> None:
        """Stop the thread (waits at most one interval + a publish); optionally withdraw."""
        self._stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout=self._interval_s + 5.0)
            if self._thread.is_alive():
                logger.error("heartbeat thread did not stop in time")
            self._thread = None
        if withdraw and worker_id is not None:
            try:
                self._registry.withdraw(worker_id)
            except Dsv4Error as exc:
                logger.warning(
                    "heartbeat: withdraw of %s failed (%s); the TTL will remove it", worker_id, exc
                )

    def _run(self) -> None:
        while not self._stop_event.is_set():
            self.beat()
            self._stop_event.wait(self._interval_s)
