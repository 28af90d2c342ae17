"""router_svc.pool.WorkerPool with a scripted Info client (no network): health states, DOWN
after N failed probes and back, draining, dispatch accounting, discovery changes, task ownership."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from dsv4.discovery.static import StaticWorkerRegistry
from dsv4.types import GenerateRequest, KVLayoutInfo, SamplingParams, WorkerInfo, WorkerRole
from router_svc.clients import WorkerCallError
from router_svc.pool import PoolSettings, WorkerPool
from router_svc.view import WorkerHealth

SETTINGS = PoolSettings(probe_interval_s=0.01, probe_timeout_s=0.1, num_failures_to_down=2)


class FakeClients:
    """Answers Info from a dict; an address mapped to None fails with UNAVAILABLE."""

    def __init__(self) -> None:
        self.infos: dict[str, WorkerInfo | None] = {}
        self.retired: list[str] = []
        self.num_info_calls = 0

    async def info(self, address: str, listed_role: WorkerRole, timeout_s: float) -> WorkerInfo:
        self.num_info_calls += 1
        info = self.infos.get(address)
        if info is None:
            raise WorkerCallError(address, "Info", grpc.StatusCode.UNAVAILABLE, "down")
        return info

    def retire(self, address: str) -> None:
        self.retired.append(address)


def info(address: str, role: WorkerRole, **fields: Any) -> WorkerInfo:
    return WorkerInfo(
        worker_id=f"id-{address}",
        role=role,
        address=address,
        layout=KVLayoutInfo(1, "h1", 1024, 256),
        vocab_size=1000,
        max_model_len=4096,
        **fields,
    )


def make_pool(
    prefill: list[str], decode: list[str], **kw: Any
) -> tuple[WorkerPool, FakeClients, StaticWorkerRegistry]:
    clients = FakeClients()
    registry = StaticWorkerRegistry(prefill, decode)
    return WorkerPool(registry, clients, SETTINGS, **kw), clients, registry  # type: ignore[arg-type]


def test_states_down_after_n_failures_and_back() -> None:
    async def body() -> None:
        downs: list[tuple[str, str]] = []
        pool, clients, _ = make_pool(["p:1"], ["d:1"], on_down=lambda a, r: downs.append((a, r)))
        await pool.probe_once()
        assert {w.health for w in pool.snapshot().workers} == {WorkerHealth.UNKNOWN}
        clients.infos = {
            "p:1": info("p:1", WorkerRole.PREFILL),
            "d:1": info("d:1", WorkerRole.DECODE),
        }
        await pool.probe_once()
        assert all(w.is_routable for w in pool.snapshot().workers) and pool.snapshot().has_route
        clients.infos["d:1"] = None
        await pool.probe_once()
        assert pool.snapshot().find("d:1").health is WorkerHealth.HEALTHY  # 1 failure: not yet
        await pool.probe_once()
        await pool.probe_once()
        assert pool.snapshot().find("d:1").health is WorkerHealth.DOWN
        assert len(downs) == 1 and "failed 2 probes in a row" in downs[0][1]
        clients.infos["d:1"] = info("d:1", WorkerRole.DECODE, is_draining=True)
        await pool.probe_once()
        assert pool.snapshot().find("d:1").health is WorkerHealth.DRAINING
        clients.infos["d:1"] = info("d:1", WorkerRole.DECODE)
        await pool.probe_once()
        assert pool.snapshot().find("d:1").health is WorkerHealth.HEALTHY

    asyncio.run(body())


def test_info_role_wins_and_colocated_workers_sit_in_the_decode_list() -> None:
    async def body() -> None:
        pool, clients, _ = make_pool([], ["c:1"])
        clients.infos = {"c:1": info("c:1", WorkerRole.COLOCATED)}
        await pool.probe_once()
        view = pool.snapshot().find("c:1")
        assert view.role is WorkerRole.COLOCATED and view.worker_id == "id-c:1"

    asyncio.run(body())


def test_dispatches_count_until_the_next_probe() -> None:
    async def body() -> None:
        pool, clients, _ = make_pool(["p:1"], ["d:1"])
        clients.infos = {
            "p:1": info("p:1", WorkerRole.PREFILL, num_queued_tokens=10),
            "d:1": info("d:1", WorkerRole.DECODE, num_free_blocks=100),
        }
        await pool.probe_once()
        request = GenerateRequest("r", tuple(range(300)), SamplingParams(max_new_tokens=300))
        pool.note_dispatch("p:1", request)
        pool.note_dispatch("d:1", request)
        snapshot = pool.snapshot()
        assert snapshot.find("p:1").num_queued_tokens == 310
        assert snapshot.find("d:1").num_free_blocks == 100 - 3  # 600 tokens / 256 per block
        assert snapshot.find("d:1").num_running_requests == 1
        await pool.probe_once()  # the worker now reports the load itself
        assert pool.snapshot().find("p:1").num_queued_tokens == 10

    asyncio.run(body())


def test_workers_leaving_discovery_are_dropped_failed_and_their_channels_retired() -> None:
    async def body() -> None:
        downs: list[tuple[str, str]] = []
        pool, clients, registry = make_pool(
            ["p:1"], ["d:1", "d:2"], on_down=lambda a, r: downs.append((a, r))
        )
        clients.infos = {
            a: info(a, WorkerRole.DECODE, is_draining=a == "d:2") for a in ("d:1", "d:2")
        }
        await pool.probe_once()
        registry.withdraw("decode@d:1")
        registry.withdraw("decode@d:2")
        await pool.probe_once()
        assert [w.address for w in pool.snapshot().workers] == ["p:1"]
        assert clients.retired == ["d:1", "d:2"]
        # Its streams are failed in the same round (the router's on_down), with the reason.
        assert [a for a, _ in downs] == ["d:1", "d:2"]
        assert "id-d:1" in downs[0][1] and "record expired or was withdrawn" in downs[0][1]
        assert "left discovery after draining" in downs[1][1]

    asyncio.run(body())


def test_background_probes_and_suspect_probes_are_owned_and_stopped() -> None:
    async def body() -> None:
        rounds: list[int] = []

        async def on_round(snapshot: Any) -> None:
            rounds.append(len(snapshot.workers))

        pool, clients, _ = make_pool(["p:1"], [], on_round=on_round)
        clients.infos = {"p:1": info("p:1", WorkerRole.PREFILL)}
        await pool.start()
        await asyncio.sleep(0.1)
        assert len(rounds) >= 3
        calls = clients.num_info_calls
        pool.report_suspect("p:1")
        await asyncio.sleep(0)
        await pool.stop()
        assert clients.num_info_calls >= calls + 1
        stopped_at = clients.num_info_calls
        await asyncio.sleep(0.05)
        assert clients.num_info_calls == stopped_at  # nothing runs after stop

    asyncio.run(body())


class FlakyRegistry:
    """A registry whose list is stale (discovery down) or a given set of decode workers."""

    def __init__(self, decode: list[str]) -> None:
        from dsv4.discovery import WorkerRecord

        self._record = lambda a: WorkerRecord("decode", f"id-{a}", a, "local", b"", "h1")
        self.decode, self.is_stale = decode, False

    def list(self, role: str, *, include_draining: bool = False):
        from dsv4.discovery.base import PoolView

        workers = tuple(self._record(a) for a in self.decode) if role == "decode" else ()
        return PoolView(role, workers, self.is_stale, 0.0)

    def close(self) -> None:
        pass


def test_workers_are_kept_while_discovery_comes_back_empty_after_an_outage() -> None:
    async def body() -> None:
        registry, clients = FlakyRegistry(["d:1"]), FakeClients()
        settings = PoolSettings(probe_interval_s=0.01, probe_timeout_s=0.1, keep_after_outage_s=0.3)
        pool = WorkerPool(registry, clients, settings)  # type: ignore[arg-type]
        clients.infos = {"d:1": info("d:1", WorkerRole.DECODE)}
        await pool.probe_once()
        registry.is_stale = True  # Redis down: the last list, marked stale
        await pool.probe_once()
        registry.decode, registry.is_stale = [], False  # Redis back, empty (nobody beat yet)
        await pool.probe_once()
        assert pool.snapshot().find("d:1").is_routable
        await asyncio.sleep(0.35)
        await pool.probe_once()  # still missing after the grace: it really left
        assert pool.snapshot().find("d:1") is None and clients.retired == ["d:1"]

    asyncio.run(body())
