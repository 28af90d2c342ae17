"""P's KV leases: held blocks exported through the transport until D pulls them, D or the router
releases them, or the lease expires.

One background task (`start` / `stop`) owns the table: every `poll_interval_s` (~2 ms) while
leases are live it drives `transport.progress()` (NIXL without a progress thread needs it for
D's READs to complete) and ends the leases D reported as pulled; it also ends expired leases.
Ending a lease is always: remove it from the table, `transport.release` (zeroes the lease slot,
so a pull racing it is reported FAILED on D, never silently wrong), then free the engine's hold.
Event-loop thread only; `__len__` and `find_leaks` may be read from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass

from dsv4.engine.async_engine import AsyncEngine
from dsv4.transfer import ExportedBlocks, KVTransport
from dsv4.types import ReleaseResult

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.002
IDLE_INTERVAL_S = 0.05


@dataclass(frozen=True)
class Lease:
    lease_id: str
    request_id: str
    num_blocks: int
    expires_at_s: float  # time.monotonic()
    expires_at_unix_ms: int


class LeaseTable:
    def __init__(self, engine: AsyncEngine, transport: KVTransport, ttl_s: float) -> None:
        self._engine = engine
        self._transport = transport
        self._ttl_s = ttl_s
        self._by_request: dict[str, Lease] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.num_expired = 0
        self.num_pulled = 0

    def __len__(self) -> int:
        return len(self._by_request)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="lease-table")
        self._task.add_done_callback(_log_death)

    async def stop(self) -> None:
        """Cancel the task and end every lease (shutdown)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for request_id in list(self._by_request):
            await self._end(request_id, "shutdown")

    # ---- leases ------------------------------------------------------------------------------
    def export(self, request_id: str, block_ids: tuple[int, ...]) -> tuple[Lease, ExportedBlocks]:
        """Put a finished prefill's held blocks under a new lease. Raises what `export` raises
        (the caller then frees the hold)."""
        exported = self._transport.export(request_id, list(block_ids))
        now_s, now_unix = time.monotonic(), time.time()
        lease = Lease(
            lease_id=uuid.uuid4().hex,
            request_id=request_id,
            num_blocks=len(block_ids),
            expires_at_s=now_s + self._ttl_s,
            expires_at_unix_ms=int((now_unix + self._ttl_s) * 1000),
        )
        self._by_request[request_id] = lease
        self._wake.set()
        return lease, exported

    async def release(self, lease_id: str, request_id: str = "") -> ReleaseResult:
        """Release RPC (from D after its pull, or the router on cleanup)."""
        lease = next((x for x in self._by_request.values() if x.lease_id == lease_id), None)
        if lease is None or (request_id and lease.request_id != request_id):
            return ReleaseResult(was_found=False)
        await self._end(lease.request_id, "released")
        return ReleaseResult(was_found=True, num_freed_blocks=lease.num_blocks)

    async def _end(self, request_id: str, why: str) -> bool:
        lease = self._by_request.pop(request_id, None)
        if lease is None:
            return False
        self._transport.release(request_id)
        await self._engine.release_hold(request_id)
        logger.debug("lease %s of %s ended: %s", lease.lease_id, request_id, why)
        return True

    # ---- the owner task ------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("lease table tick failed; continuing")
            if self._by_request:
                await asyncio.sleep(POLL_INTERVAL_S)
            else:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):  # idle: wake up now and then anyway
                    await asyncio.wait_for(self._wake.wait(), IDLE_INTERVAL_S)

    async def _tick(self) -> None:
        for request_id in self._transport.progress():
            if await self._end(request_id, "pulled"):
                self.num_pulled += 1
        now_s = time.monotonic()
        for lease in [x for x in self._by_request.values() if x.expires_at_s <= now_s]:
            logger.warning(
                "lease %s of %s expired after %.1f s unpulled; freeing %d blocks",
                lease.lease_id, lease.request_id, self._ttl_s, lease.num_blocks,
            )  # fmt: skip
            if await self._end(lease.request_id, "expired"):
                self.num_expired += 1

    def find_leaks(self) -> list[str]:
        return [
            f"lease {x.lease_id} of {x.request_id} still held" for x in self._by_request.values()
        ]


def _log_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("lease table task died", exc_info=task.exception())
