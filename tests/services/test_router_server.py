"""The router server's own duties, against scripted peers (tests.router_fakes.scripted_workers): health checking,
reflection, API keys, admission and rate limits, the shared secret towards workers, input
validation with worker-reported limits, pool states, and many concurrent streams."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from dsv4.rpc.v1 import common_pb2, router_pb2
from router_svc.server import ROUTER_SERVICE_NAME
from tests.router_fakes.harness import generate_request, scripted_cluster
from tests.router_fakes.scripted_workers import (
    ScriptedDecodeWorker,
    ScriptedPrefillWorker,
    WorkerScript,
    next_token,
)

PROMPT = [5, 6, 7, 8]


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = 8.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def pair(**p_script: Any) -> tuple[list[ScriptedPrefillWorker], list[ScriptedDecodeWorker]]:
    return [ScriptedPrefillWorker("p0", WorkerScript(**p_script))], [ScriptedDecodeWorker("d0")]


async def status_of(coro: Coroutine[Any, Any, Any]) -> tuple[grpc.StatusCode, str, Any]:
    try:
        return grpc.StatusCode.OK, "", await coro
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or "", exc


async def collect(stub: Any, request: Any, **kw: Any) -> list[Any]:
    return [m async for m in stub.Generate(request, **kw)]


def test_health_and_reflection_answer() -> None:
    async def body() -> None:
        async with scripted_cluster(*pair()) as c:
            health = health_pb2_grpc.HealthStub(c.channel)
            for service in ("", ROUTER_SERVICE_NAME):
                answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(c.channel)
            query = reflection_pb2.ServerReflectionRequest(list_services="")
            answers = [a async for a in reflection.ServerReflectionInfo(iter([query]))]
            names = {s.name for s in answers[0].list_services_response.service}
            assert {ROUTER_SERVICE_NAME, "grpc.health.v1.Health"} <= names

    run(body())


def test_readiness_follows_the_pool_and_a_worker_comes_back() -> None:
    async def body() -> None:
        prefills, decodes = pair()
        async with scripted_cluster(prefills, decodes) as c:
            health = health_pb2_grpc.HealthStub(c.channel)
            check = health_pb2.HealthCheckRequest(service=ROUTER_SERVICE_NAME)
            decodes[0].script.info_mode = "fail"
            await asyncio.sleep(0.4)
            assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.NOT_SERVING
            code, details, _ = await status_of(collect(c.stub, generate_request(3, PROMPT)))
            assert (
                code == grpc.StatusCode.UNAVAILABLE
                and "decode pool: 0 healthy of 1 (1 down)" in details
            )
            decodes[0].script.info_mode = "ok"
            await asyncio.sleep(0.3)
            assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.SERVING
            assert len(await collect(c.stub, generate_request(3, PROMPT))) == 3

    run(body())


def test_no_workers_and_incompatible_layouts_say_why() -> None:
    async def body() -> None:
        async with scripted_cluster() as c:
            code, details, _ = await status_of(collect(c.stub, generate_request(3, PROMPT)))
            assert code == grpc.StatusCode.UNAVAILABLE and "no worker has reported" in details
        d0 = ScriptedDecodeWorker("d0", WorkerScript(layout_hash="layout-b"))
        async with scripted_cluster([ScriptedPrefillWorker("p0")], [d0]) as c:
            code, details, _ = await status_of(collect(c.stub, generate_request(3, PROMPT)))
            assert code == grpc.StatusCode.UNAVAILABLE and "incompatible" in details
            assert "layout-a" in details and "layout-b" in details

    run(body())


def test_draining_workers_take_nothing_new() -> None:
    async def body() -> None:
        prefills = [
            ScriptedPrefillWorker("p0", WorkerScript(is_draining=True)),
            ScriptedPrefillWorker("p1", WorkerScript(num_queued_tokens=1000)),
        ]
        async with scripted_cluster(prefills, [ScriptedDecodeWorker("d0")]) as c:
            messages = await collect(c.stub, generate_request(2, PROMPT))
            assert messages[-1].usage.prefill_worker_id == "p1" and not prefills[0].log.requests

    run(body())


def test_invalid_requests_get_invalid_argument_with_limits_from_workers() -> None:
    async def body() -> None:
        async with scripted_cluster(*pair(max_model_len=64)) as c:
            bad = [
                generate_request(3, [5, 1000]),  # outside the scripted vocabulary of 1000
                generate_request(3, []),
                generate_request(3, list(range(64))),  # no room left in max_model_len=64
                generate_request(3, PROMPT, temperature=-1.0),
                generate_request(3, PROMPT, request_id="bad id!"),
            ]
            for request in bad:
                code, details, _ = await status_of(collect(c.stub, request))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (request, details)
            info = await c.stub.GetModelInfo(router_pb2.GetModelInfoRequest())
            assert (info.max_model_len, info.vocab_size, info.eos_token_id) == (64, 1000, 1)

    run(body())


def test_duplicate_live_request_id_is_refused() -> None:
    async def body() -> None:
        d0 = ScriptedDecodeWorker("d0", WorkerScript(token_delay_s=0.05))
        async with scripted_cluster([ScriptedPrefillWorker("p0")], [d0]) as c:
            first = c.stub.Generate(generate_request(10, PROMPT, request_id="same"))
            await first.read()
            code, details, _ = await status_of(
                collect(c.stub, generate_request(3, PROMPT, request_id="same"))
            )
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "already running" in details
            rest = []
            while (msg := await first.read()) is not grpc.aio.EOF:
                rest.append(msg)
            assert len(rest) == 9

    run(body())


def test_admission_limit_and_rate_limit_answer_resource_exhausted() -> None:
    async def body() -> None:
        d0 = ScriptedDecodeWorker("d0", WorkerScript(token_delay_s=0.1))
        settings = {"router__max_inflight_requests": 1}
        async with scripted_cluster([ScriptedPrefillWorker("p0")], [d0], **settings) as c:
            busy = c.stub.Generate(generate_request(5, PROMPT))
            await busy.read()
            code, details, exc = await status_of(collect(c.stub, generate_request(2, PROMPT)))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry after" in details
            assert dict(exc.trailing_metadata())["grpc-retry-pushback-ms"] == "1000"
            busy.cancel()
        settings = {"router__rate_limit_rps": 1.0, "router__rate_limit_burst": 2}
        async with scripted_cluster(*pair(), **settings) as c:
            for _ in range(2):
                await collect(c.stub, generate_request(2, PROMPT))
            code, details, _ = await status_of(collect(c.stub, generate_request(2, PROMPT)))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "rate limit" in details

    run(body())


def test_api_keys_and_the_shared_secret_towards_workers() -> None:
    async def body() -> None:
        secret = WorkerScript(required_token="s3cret")
        prefills, decodes = (
            [ScriptedPrefillWorker("p0", secret)],
            [ScriptedDecodeWorker("d0", secret)],
        )
        settings = {"router__api_keys": ("k1", "k2"), "security__shared_secret": "s3cret"}
        async with scripted_cluster(prefills, decodes, **settings) as c:
            for metadata in ((), (("authorization", "Bearer nope"),), (("authorization", "k1"),)):
                code, _, _ = await status_of(
                    collect(c.stub, generate_request(2, PROMPT), metadata=metadata)
                )
                assert code == grpc.StatusCode.UNAUTHENTICATED
            code, _, _ = await status_of(c.stub.GetModelInfo(router_pb2.GetModelInfoRequest()))
            assert code == grpc.StatusCode.UNAUTHENTICATED
            ok = await collect(
                c.stub, generate_request(2, PROMPT), metadata=(("authorization", "Bearer k2"),)
            )
            assert [t for m in ok for t in m.token_ids] == [
                next_token(4, 1000),
                next_token(5, 1000),
            ]

    run(body())


def test_two_hundred_concurrent_streams_complete() -> None:
    async def body() -> None:
        prefills = [ScriptedPrefillWorker(f"p{i}") for i in range(2)]
        decodes = [ScriptedDecodeWorker(f"d{i}") for i in range(2)]
        async with scripted_cluster(prefills, decodes) as c:
            started = time.monotonic()
            results = await asyncio.gather(
                *(collect(c.stub, generate_request(8, [i % 50 + 2, 3, 4])) for i in range(200))
            )
            elapsed_s = time.monotonic() - started
            assert all(
                len(r) == 8 and r[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
                for r in results
            )
            assert all(len(w.log.requests) > 20 for w in (*prefills, *decodes)), (
                "load was not spread"
            )
            assert elapsed_s < 6.0

    run(body(), timeout_s=9.0)


def test_a_restarted_worker_is_routed_to_again() -> None:
    async def body() -> None:
        prefills, decodes = pair()
        async with scripted_cluster(prefills, decodes) as c:
            port = int(decodes[0].address.rpartition(":")[2])
            await decodes[0].stop()
            await asyncio.sleep(0.3)
            code, _, _ = await status_of(collect(c.stub, generate_request(3, PROMPT)))
            assert code == grpc.StatusCode.UNAVAILABLE
            await decodes[0].start(port=port)
            started = time.monotonic()
            while time.monotonic() - started < 4.0:
                code, _, answer = await status_of(collect(c.stub, generate_request(3, PROMPT)))
                if code == grpc.StatusCode.OK:
                    break
                await asyncio.sleep(0.1)
            assert code == grpc.StatusCode.OK and len(answer) == 3
            assert time.monotonic() - started < 2.5

    run(body())
