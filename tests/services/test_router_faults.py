"""Fault isolation in the router, against scripted peers (tests.router_fakes.scripted_workers): a request's own
fault (INTERNAL from a failed step, OUT_OF_RANGE, ...) is returned at once and never retried
or migrated; every way a worker leaves the pool (failed probes, registry TTL expiry in a real
redis-server, withdrawal after a drain, its channel closing) ends the streams on it with a
status naming the worker and the reason, within a probe interval or so."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import grpc
import pytest
from redis_server import RedisServer, redis_server  # noqa: F401  (fixture)

from dsv4.discovery import WorkerRecord
from dsv4.discovery.redis import RedisWorkerRegistry
from dsv4.rpc.v1 import worker_pb2
from dsv4.types import DecodeRequest, GenerateRequest, SamplingParams
from router_svc.clients import CallInterrupted, ClientSettings, WorkerClients
from router_svc.pool import PoolSettings
from tests.router_fakes.harness import generate_request, read_outcome, scripted_cluster
from tests.router_fakes.scripted_workers import (
    ScriptedDecodeWorker,
    ScriptedPrefillWorker,
    WorkerScript,
)

PROMPT = list(range(10, 26))
REGISTRY_SECRET = "router-faults-registry-secret"  # records are signed with the shared secret
# Probes every 0.1 s that never mark a worker down: only the registry can remove it.
NEVER_DOWN = PoolSettings(probe_interval_s=0.1, probe_timeout_s=0.2, num_failures_to_down=10**6)


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = 10.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def eventually(predicate: Any, timeout_s: float = 3.0) -> None:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s"
        await asyncio.sleep(0.02)


# ---- a request's own fault is returned, not retried --------------------------------------------


def test_prefill_internal_is_returned_at_once_not_retried_elsewhere() -> None:
    async def body() -> None:
        bad = ScriptedPrefillWorker("p0", WorkerScript(fail_code=grpc.StatusCode.INTERNAL))
        spare = ScriptedPrefillWorker("p1", WorkerScript(num_queued_tokens=50))
        async with scripted_cluster([bad, spare], [ScriptedDecodeWorker("d0")]) as c:
            code, details, _ = await read_outcome(c.stub.Generate(generate_request(4, PROMPT)))
            assert code == grpc.StatusCode.INTERNAL, details
            assert bad.address in details and "scripted INTERNAL" in details
            assert len(bad.log.requests) == 1 and spare.log.requests == []

    run(body())


def test_request_fault_codes_keep_their_code() -> None:
    async def body() -> None:
        for fault in (grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNKNOWN):
            bad = ScriptedPrefillWorker("p0", WorkerScript(fail_code=fault))
            spare = ScriptedPrefillWorker("p1", WorkerScript(num_queued_tokens=50))
            async with scripted_cluster([bad, spare], [ScriptedDecodeWorker("d0")]) as c:
                code, _, _ = await read_outcome(c.stub.Generate(generate_request(4, PROMPT)))
                assert code == fault and spare.log.requests == []

    run(body())


def test_prefill_resource_exhausted_goes_to_another_worker() -> None:
    async def body() -> None:
        full = ScriptedPrefillWorker(
            "p0", WorkerScript(fail_code=grpc.StatusCode.RESOURCE_EXHAUSTED)
        )
        spare = ScriptedPrefillWorker("p1", WorkerScript(num_queued_tokens=50))
        async with scripted_cluster([full, spare], [ScriptedDecodeWorker("d0")]) as c:
            code, _, messages = await read_outcome(c.stub.Generate(generate_request(4, PROMPT)))
            assert code == grpc.StatusCode.OK and messages[-1].usage.prefill_worker_id == "p1"

    run(body())


def test_decode_internal_is_neither_replaced_nor_migrated() -> None:
    async def body() -> None:
        internal = grpc.StatusCode.INTERNAL
        before = ScriptedDecodeWorker("d0", WorkerScript(num_free_blocks=500, fail_code=internal))
        spare = ScriptedDecodeWorker("d1")
        async with scripted_cluster([ScriptedPrefillWorker("p0")], [before, spare]) as c:
            code, details, _ = await read_outcome(c.stub.Generate(generate_request(6, PROMPT)))
            assert code == internal and before.address in details and spare.log.requests == []
            lease = f"lease-{c.prefills[0].log.requests[0].request_id}"
            await eventually(lambda: c.prefills[0].log.released == [lease])
        script = WorkerScript(num_free_blocks=500, fail_after=2, fail_after_code=internal)
        mid = ScriptedDecodeWorker("d0", script)
        spare = ScriptedDecodeWorker("d1")
        settings = {"router__migrate_on_decode_failure": True}
        async with scripted_cluster([ScriptedPrefillWorker("p0")], [mid, spare], **settings) as c:
            code, _, messages = await read_outcome(c.stub.Generate(generate_request(8, PROMPT)))
            assert code == internal and len(messages) == 3  # P's token + 2 of D's
            assert spare.log.requests == [] and len(c.prefills[0].log.requests) == 1

    run(body())


# ---- every removal from the pool ends the streams on the worker -------------------------------


def test_probe_failure_ends_the_stream_naming_the_worker() -> None:
    async def body() -> None:
        d0 = ScriptedDecodeWorker("d0", WorkerScript(hang_after=1))
        async with scripted_cluster([ScriptedPrefillWorker("p0")], [d0]) as c:
            call = c.stub.Generate(generate_request(8, PROMPT))
            await call.read()
            d0.script.info_mode = "hang"  # frozen (SIGSTOP): no tokens, no Info answers
            code, details, _ = await read_outcome(call)
            assert code == grpc.StatusCode.UNAVAILABLE
            assert d0.address in details and "probes in a row" in details

    run(body())


def _record(worker: Any, role: str, **fields: Any) -> WorkerRecord:
    return WorkerRecord(role=role, worker_id=worker.worker_id, address=worker.address, **fields)


async def _redis_cluster_up(
    redis: RedisServer, p0: Any, d0: Any
) -> tuple[RedisWorkerRegistry, RedisWorkerRegistry]:
    """Start both workers and publish them with a TTL long enough for the whole test; the
    publisher and the router's registry (refreshing every 50 ms)."""
    await p0.start()
    await d0.start()
    publisher = RedisWorkerRegistry(redis.url, secret=REGISTRY_SECRET, ttl_s=30.0)
    publisher.publish(_record(p0, "prefill"))
    publisher.publish(_record(d0, "decode"))
    router_registry = RedisWorkerRegistry(
        redis.url, secret=REGISTRY_SECRET, refresh_interval_s=0.05
    )
    return publisher, router_registry


def test_registry_ttl_expiry_ends_the_stream_within_a_probe_interval(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """The issue's case: D frozen mid-stream, its record expires before any probe verdict."""

    async def body() -> None:
        p0 = ScriptedPrefillWorker("p0")
        d0 = ScriptedDecodeWorker("d0", WorkerScript(hang_after=1))
        publisher, router_registry = await _redis_cluster_up(redis_server, p0, d0)
        async with scripted_cluster(
            [p0], [d0], registry=router_registry, pool_settings=NEVER_DOWN
        ) as c:
            call = c.stub.Generate(generate_request(8, PROMPT))
            await call.read()
            d0.script.info_mode = "hang"
            short_ttl = RedisWorkerRegistry(redis_server.url, secret=REGISTRY_SECRET, ttl_s=0.3)
            short_ttl.publish(_record(d0, "decode"))  # its last heartbeat: expires in 0.3 s
            started = time.monotonic()
            code, details, _ = await read_outcome(call)
            assert code == grpc.StatusCode.UNAVAILABLE, details
            assert d0.address in details and "record expired" in details
            # TTL (0.3 s) + a registry refresh + a probe round; generous for a loaded CI box
            assert time.monotonic() - started < 2.5
            short_ttl.close()
        publisher.close()

    run(body())


def test_withdrawal_after_a_drain_ends_the_streams_left_on_the_worker(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    async def body() -> None:
        p0 = ScriptedPrefillWorker("p0")
        d0 = ScriptedDecodeWorker("d0", WorkerScript(token_delay_s=0.05))
        publisher, router_registry = await _redis_cluster_up(redis_server, p0, d0)
        async with scripted_cluster(
            [p0], [d0], registry=router_registry, pool_settings=NEVER_DOWN
        ) as c:
            short = c.stub.Generate(generate_request(6, PROMPT))
            long = c.stub.Generate(generate_request(200, PROMPT))
            await short.read()
            await long.read()
            await d0.Drain(worker_pb2.DrainRequest(), None)  # takes nothing new from now on
            publisher.publish(_record(d0, "decode", draining=True))
            await eventually(lambda: c.server.pool.snapshot().find(d0.address).health.value
                             == "draining")  # fmt: skip
            code, _, _ = await read_outcome(short)  # a drain lets running streams go on
            assert code == grpc.StatusCode.OK
            publisher.withdraw(d0.worker_id)  # what the worker does when its drain ends
            started = time.monotonic()
            code, details, _ = await read_outcome(long)
            assert code == grpc.StatusCode.UNAVAILABLE, details
            assert d0.address in details and "after draining" in details
            assert time.monotonic() - started < 2.0
        publisher.close()

    run(body())


def test_a_call_whose_channel_closes_under_it_ends_with_a_reason() -> None:
    """A closed channel (a retired worker's, or at shutdown) must not look like the client
    going away: the flow gets CallInterrupted and answers UNAVAILABLE."""

    async def body() -> None:
        d0 = ScriptedDecodeWorker("d0", WorkerScript(hang_after=1))
        await d0.start()
        clients = WorkerClients(ClientSettings())
        try:
            request = GenerateRequest("r1", tuple(PROMPT), SamplingParams(max_new_tokens=8))
            call = clients.start_decode(d0.address, DecodeRequest(request), timeout_s=30.0)
            assert (await call.read()) is not None
            closing = asyncio.create_task(clients.close())
            with pytest.raises(CallInterrupted, match="closed its channel"):
                await call.read()
            await closing
        finally:
            await clients.close()
            await d0.stop()

    run(body())
