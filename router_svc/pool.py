"""The router's live view of its workers: discovery's list plus periodic Info probes.

`WorkerPool` owns one background task that, every `probe_interval_s`, reads the registry (in a
thread: the Redis registry does blocking I/O) and sends `Info` to every listed worker with a
bounded timeout. A worker that fails `num_failures_to_down` probes in a row is marked DOWN and
`on_down(address, reason)` fires (the router then fails or migrates the streams on it); it is
routable again as soon as it answers. A worker that leaves discovery (its registry record
expired, or it withdrew it after a drain) is removed and `on_down` fires too, in the same
round: a stream is never left on a worker the router no longer watches. Request flows report a suspicious failure with
`report_suspect`, which probes that worker at once instead of waiting for the next round.
Everything runs on the router's event loop; `snapshot()` is cheap and synchronous.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from dsv4.config import ServeConfig
from dsv4.discovery import WorkerRecord, WorkerRegistry
from dsv4.errors import Dsv4Error
from dsv4.types import GenerateRequest, WorkerInfo, WorkerRole
from router_svc.clients import WorkerCallError, WorkerClients
from router_svc.view import PoolSnapshot, WorkerHealth, WorkerView

logger = logging.getLogger(__name__)

WorkerDownCallback = Callable[[str, str], None]  # (address, reason)
RoundCallback = Callable[[PoolSnapshot], Awaitable[None]]
_LISTED_ROLES = {"prefill": WorkerRole.PREFILL, "decode": WorkerRole.DECODE}


@dataclass(frozen=True, slots=True)
class PoolSettings:
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 1.0
    num_failures_to_down: int = 3
    # After discovery was unreachable, workers missing from its list are kept this long: a
    # restarted Redis is empty until every worker's next heartbeat re-publishes it.
    keep_after_outage_s: float = 5.0

    @classmethod
    def from_config(cls, cfg: ServeConfig) -> PoolSettings:
        """Probe as often as workers heartbeat; a dead worker is DOWN after ~3 intervals."""
        interval_s = cfg.discovery.heartbeat_s
        return cls(
            probe_interval_s=interval_s,
            probe_timeout_s=min(2.0, max(0.25, interval_s)),
            keep_after_outage_s=cfg.discovery.ttl_s,
        )


@dataclass
class _Slot:
    """Mutable per-worker state; never leaves this module (snapshots copy it into views)."""

    address: str
    listed_role: WorkerRole
    record: WorkerRecord
    info: WorkerInfo | None = None
    health: WorkerHealth = WorkerHealth.UNKNOWN
    num_failures: int = 0
    is_probing: bool = False
    # The router's own dispatches since the last successful probe (Info does not show them yet).
    queued_tokens_since_probe: int = 0
    blocks_since_probe: int = 0
    running_since_probe: int = 0

    def view(self) -> WorkerView:
        info = self.info
        if info is None:
            role = self.listed_role
            return WorkerView(
                self.address,
                self.record.worker_id,
                role,
                self.health,
                num_consecutive_failures=self.num_failures,
            )
        return WorkerView(
            address=self.address,
            worker_id=info.worker_id,
            role=info.role,
            health=self.health,
            layout_hash=info.layout_hash,
            block_size_tokens=info.layout.block_size_tokens if info.layout else 0,
            num_free_blocks=max(0, info.num_free_blocks - self.blocks_since_probe),
            num_queued_tokens=info.num_queued_tokens + self.queued_tokens_since_probe,
            num_running_requests=info.num_running_requests + self.running_since_probe,
            model_name=info.model_name,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            num_consecutive_failures=self.num_failures,
            speculative_method=info.speculative_method,
        )


class WorkerPool:
    """Owned by the RouterServer: `await start()` probes once (so a router started after its
    workers can route at once) and starts the loop; `await stop()` cancels it."""

    def __init__(
        self,
        registry: WorkerRegistry,
        clients: WorkerClients,
        settings: PoolSettings = PoolSettings(),
        *,
        on_down: WorkerDownCallback | None = None,
        on_round: RoundCallback | None = None,
    ) -> None:
        self._registry, self._clients, self._settings = registry, clients, settings
        self._on_down, self._on_round = on_down, on_round
        self._slots: dict[str, _Slot] = {}
        self._is_registry_stale = False
        self._stale_at_s = float("-inf")  # when discovery was last seen unreachable
        self._loop_task: asyncio.Task[None] | None = None
        self._suspect_probes: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.probe_once()
        self._loop_task = asyncio.create_task(self._run(), name="router-pool-probes")

    async def stop(self) -> None:
        tasks = [t for t in (self._loop_task, *self._suspect_probes) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop_task = None

    def snapshot(self) -> PoolSnapshot:
        views = tuple(self._slots[a].view() for a in sorted(self._slots))
        return PoolSnapshot(views, self._is_registry_stale)

    def note_dispatch(self, address: str, request: GenerateRequest) -> None:
        """A flow sent `request` to this worker: count it until the next probe shows it."""
        slot = self._slots.get(address)
        if slot is None or slot.info is None:
            return
        if slot.info.role is not WorkerRole.DECODE:  # prefill and colocated queue the prompt
            slot.queued_tokens_since_probe += request.num_prompt_tokens
        if slot.info.role is not WorkerRole.PREFILL:  # decode and colocated hold blocks
            num_tokens = request.num_prompt_tokens + request.sampling.max_new_tokens
            block_size = slot.info.layout.block_size_tokens if slot.info.layout else 0
            slot.blocks_since_probe += math.ceil(num_tokens / block_size) if block_size else 1
        slot.running_since_probe += 1

    def report_suspect(self, address: str) -> None:
        """A call to this worker failed as if it were gone: probe it now (one at a time)."""
        slot = self._slots.get(address)
        if slot is None or slot.is_probing:
            return
        task = asyncio.create_task(self._probe(slot), name=f"probe {address}")
        self._suspect_probes.add(task)
        task.add_done_callback(self._suspect_probes.discard)

    async def probe_once(self) -> None:
        """One round: re-list, probe every worker concurrently, then call `on_round`."""
        listed = await asyncio.to_thread(self._list_registry)
        if listed is not None:
            self._sync_slots(listed)
        await asyncio.gather(*(self._probe(s) for s in list(self._slots.values())))
        if self._on_round is not None:
            await self._on_round(self.snapshot())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._settings.probe_interval_s)
            try:
                await self.probe_once()
            except Exception:
                logger.exception("pool: probe round failed; trying again next interval")

    def _list_registry(self) -> list[tuple[WorkerRole, WorkerRecord]] | None:
        listed: list[tuple[WorkerRole, WorkerRecord]] = []
        is_stale = False
        try:
            for name, role in _LISTED_ROLES.items():
                view = self._registry.list(name, include_draining=True)
                is_stale = is_stale or view.is_stale
                listed.extend((role, record) for record in view.workers)
        except Dsv4Error as exc:
            logger.warning("pool: cannot list workers (%s); keeping the last list", exc)
            self._is_registry_stale, self._stale_at_s = True, time.monotonic()
            return None
        self._is_registry_stale = is_stale
        if is_stale:  # the registry's last known list: additions apply, removals wait
            self._stale_at_s = time.monotonic()
        return listed

    def _sync_slots(self, listed: list[tuple[WorkerRole, WorkerRecord]]) -> None:
        seen = set()
        for role, record in listed:
            seen.add(record.address)
            slot = self._slots.get(record.address)
            if slot is None:
                logger.info(
                    "pool: new %s worker %s at %s", role.value, record.worker_id, record.address
                )
                self._slots[record.address] = _Slot(record.address, role, record)
            else:
                slot.record = record
        if time.monotonic() - self._stale_at_s < self._settings.keep_after_outage_s:
            return  # discovery just came back, maybe empty: workers re-publish within a beat
        for address in [a for a in self._slots if a not in seen]:
            slot = self._slots.pop(address)
            how = (
                "after draining"
                if slot.health is WorkerHealth.DRAINING
                else "(its registry record expired or was withdrawn)"
            )
            reason = f"worker {slot.view().worker_id} at {address} left discovery {how}"
            logger.info("pool: %s", reason)
            if self._on_down is not None:
                self._on_down(address, reason)  # its streams fail or migrate now
            self._clients.retire(address)

    async def _probe(self, slot: _Slot) -> None:
        if slot.is_probing:
            return
        slot.is_probing = True
        pending = (
            slot.queued_tokens_since_probe,
            slot.blocks_since_probe,
            slot.running_since_probe,
        )
        try:
            info = await self._clients.info(
                slot.address, slot.listed_role, self._settings.probe_timeout_s
            )
        except WorkerCallError as exc:
            self._on_probe_failure(slot, f"Info failed: {exc.code.name}: {exc.details}")
        except Dsv4Error as exc:  # a malformed WorkerInfo
            self._on_probe_failure(slot, f"Info answer rejected: {exc}")
        else:
            slot.queued_tokens_since_probe -= pending[0]
            slot.blocks_since_probe -= pending[1]
            slot.running_since_probe -= pending[2]
            self._on_probe_success(slot, info)
        finally:
            slot.is_probing = False

    def _on_probe_success(self, slot: _Slot, info: WorkerInfo) -> None:
        is_colocated_in_decode_list = (
            info.role is WorkerRole.COLOCATED and slot.listed_role is WorkerRole.DECODE
        )
        if (
            slot.info is None
            and info.role is not slot.listed_role
            and not is_colocated_in_decode_list
        ):
            logger.warning(
                "pool: %s is listed as %s but reports role %s; using %s",
                slot.address,
                slot.listed_role.value,
                info.role.value,
                info.role.value,
            )
        is_draining = info.is_draining or slot.record.draining
        health = WorkerHealth.DRAINING if is_draining else WorkerHealth.HEALTHY
        if slot.health is not health:
            logger.info("pool: %s (%s) is %s", info.worker_id, slot.address, health.value)
        slot.info, slot.health, slot.num_failures = info, health, 0

    def _on_probe_failure(self, slot: _Slot, reason: str) -> None:
        slot.num_failures += 1
        if slot.health in (WorkerHealth.UNKNOWN, WorkerHealth.DOWN):
            if slot.num_failures == 1:
                logger.warning("pool: %s does not answer yet: %s", slot.address, reason)
            return
        if slot.num_failures < self._settings.num_failures_to_down:
            logger.debug(
                "pool: %s probe failed (%d in a row): %s", slot.address, slot.num_failures, reason
            )
            return
        slot.health = WorkerHealth.DOWN
        down_reason = f"worker {slot.address} failed {slot.num_failures} probes in a row ({reason})"
        logger.warning("pool: %s", down_reason)
        if self._on_down is not None:
            self._on_down(slot.address, down_reason)
