"""Faults on a real cluster (router + 2 P + 2 D processes, loopback, NIXL): a D that stops
answering (SIGSTOP), a P killed after Prefill answered but before D pulled, a D killed
mid-stream with migration on, and a graceful drain. Every scenario is bounded by deadlines,
measured, and ends with the leak check over the survivors' Info. Order matters (module-scoped
cluster; workers die on the way): the tests run top to bottom."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Coroutine
from typing import Any

import grpc
import pytest
from e2e_cluster import ExtraRouter, assert_no_worker_leaks, generate, greedy, kill

from dsv4 import wire
from dsv4.commands.cluster import AUTO_PORTS, free_port
from dsv4.rpc.v1 import router_pb2, router_pb2_grpc, worker_pb2
from dsv4.serving.metrics import scrape
from dsv4.types import FinishReason, GenerateRequest, PullFailurePolicy
from tests.services.worker_cluster import (
    METADATA,
    PROMPTS,
    Workers,
    start_cluster,
    tiny_checkpoint,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
LONG_PROMPT = [(13 * i) % 997 + 2 for i in range(1500)]


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = 90.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return tiny_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache")


@pytest.fixture(scope="module")
def cluster(model_dir):
    cluster = start_cluster(
        model_dir, num_prefill=2, num_decode=2, router_port=free_port(),
        metrics_base_port=AUTO_PORTS,
    )  # fmt: skip
    yield cluster
    cluster.stop()


async def running_on(cluster, role: str) -> list[str]:
    """Names of the live `role` workers with a request in progress (Info)."""
    names = []
    for service in cluster.services:
        if service.role != role or service.process.poll() is not None:
            continue
        w = Workers(service.address, service.address)
        try:
            if (await w.info(role)).num_running_requests:
                names.append(service.name)
        finally:
            await w.close()
    return names


async def routable_decodes(channel: grpc.aio.Channel) -> int:
    info = await router_pb2_grpc.RouterStub(channel).GetModelInfo(
        router_pb2.GetModelInfoRequest(), timeout=5
    )
    return info.num_decode_workers


async def wait_until(predicate, timeout_s: float) -> float:
    """Seconds until `await predicate()` is true; fails after timeout_s."""
    started_s = time.monotonic()
    while not await predicate():
        assert time.monotonic() - started_s < timeout_s, f"not within {timeout_s} s"
        await asyncio.sleep(0.1)
    return time.monotonic() - started_s


def test_stopped_decode_worker_is_failed_over_and_routed_to_again_after_sigcont(cluster) -> None:
    async def body() -> dict[str, float]:
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            msg = wire.generate_request_to_proto(PROMPTS[0], greedy(3000), request_id="stop-1")
            call = stub.Generate(msg, timeout=60)
            for _ in range(3):
                await call.read()
            (victim,) = await running_on(cluster, "decode")
            pid = cluster.service(victim).process.pid
            os.kill(pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                with pytest.raises(grpc.aio.AioRpcError) as failure:
                    while await call.read() is not grpc.aio.EOF:
                        pass
                assert failure.value.code() is grpc.StatusCode.UNAVAILABLE
                failed_after_s = time.monotonic() - stopped_at
                assert await routable_decodes(channel) == 1
                outcomes = await asyncio.gather(
                    *(generate(channel, p, greedy(4), timeout_s=20) for p in PROMPTS)
                )
                assert [o.code for o in outcomes] == [grpc.StatusCode.OK] * len(PROMPTS)
                assert all(o.chunks[-1].usage.decode_worker_id != victim for o in outcomes)
            finally:
                os.kill(pid, signal.SIGCONT)
            back_after_s = await wait_until(
                lambda: _equals(routable_decodes(channel), 2), timeout_s=15
            )
            outcomes = await asyncio.gather(
                *(generate(channel, PROMPTS[0], greedy(3)) for _ in range(6))
            )
            assert {o.chunks[-1].usage.decode_worker_id for o in outcomes} >= {victim}
        await assert_no_worker_leaks(cluster)
        return {"failed_after_s": failed_after_s, "routable_again_after_s": back_after_s}

    times = run(body())
    print(f"SIGSTOP decode: {times}")
    assert times["failed_after_s"] < 10.0


async def _equals(value: Coroutine[Any, Any, int], expected: int) -> bool:
    return await value == expected


def test_prefill_killed_before_the_pull_recomputes_or_fails_by_policy(cluster) -> None:
    decode_address = cluster.service("decode-0").address

    async def body() -> dict[str, float]:
        survivor = Workers(cluster.service("prefill-0").address, decode_address)
        victim = Workers(cluster.service("prefill-1").address, decode_address)
        try:
            requests = {
                policy: GenerateRequest(f"pk-{policy.value}", tuple(LONG_PROMPT), greedy(6))
                for policy in PullFailurePolicy
            }
            expected, _ = await survivor.generate(
                GenerateRequest("pk-reference", tuple(LONG_PROMPT), greedy(6))
            )
            prefills = {p: await victim.prefill_request(r) for p, r in requests.items()}
            kill(cluster, "prefill-1")  # P answered Prefill; D has not pulled yet
            started_s = time.monotonic()
            policy = PullFailurePolicy.RECOMPUTE
            stream = victim.decode_stream(requests[policy], prefills[policy], policy)
            chunks = [wire.decode_response_from_proto(m) async for m in stream]
            recompute_s = time.monotonic() - started_s
            assert chunks[-1].usage.prefill_was_recomputed
            tokens = [prefills[policy].first_token_id] + [t for c in chunks for t in c.token_ids]
            assert tokens == expected
            started_s = time.monotonic()
            policy = PullFailurePolicy.FAIL
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                [m async for m in victim.decode_stream(requests[policy], prefills[policy], policy)]
            assert failure.value.code() is grpc.StatusCode.UNAVAILABLE
            fail_s = time.monotonic() - started_s
        finally:
            await survivor.close()
            await victim.close()
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            outcomes = [await generate(channel, PROMPTS[1], greedy(4)) for _ in range(3)]
        assert [o.code for o in outcomes] == [grpc.StatusCode.OK] * 3
        await assert_no_worker_leaks(cluster)
        return {"recompute_s": recompute_s, "fail_s": fail_s}

    times = run(body())
    print(f"kill -9 P before the pull: {times}")
    assert times["fail_s"] < 5.0  # bounded by transfer.pull_timeout_s (2 s) + slack
    m = scrape(cluster.service("decode-0").metrics_url)
    assert m["dsv4_decode_prefill_recomputes_total"] >= 1
    assert m["dsv4_decode_kv_pull_failures_total"] >= 2


def test_killed_decode_mid_stream_migrates_to_the_other_decode(cluster, model_dir) -> None:
    router = ExtraRouter(
        str(model_dir), cluster.addresses("prefill")[:1], cluster.addresses("decode"),
        "--migrate-on-decode-failure",
    )  # fmt: skip
    try:
        router.wait_ready()

        async def body() -> tuple[Any, float]:
            async with grpc.aio.insecure_channel(router.address) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                msg = wire.generate_request_to_proto(PROMPTS[0], greedy(300), request_id="mig-1")
                call = stub.Generate(msg, timeout=90)
                chunks = [wire.generate_response_from_proto(await call.read()) for _ in range(3)]
                (victim,) = await running_on(cluster, "decode")
                kill(cluster, victim)
                killed_at = time.monotonic()
                while (reply := await call.read()) is not grpc.aio.EOF:
                    chunks.append(wire.generate_response_from_proto(reply))
                seconds = time.monotonic() - killed_at
            await assert_no_worker_leaks(cluster)
            return chunks, seconds, victim

        chunks, seconds, victim = run(body())
    finally:
        router.stop()
    print(f"kill -9 D mid-stream with migration: the stream finished {seconds:.2f} s later")
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert sum(len(c.token_ids) for c in chunks) == 300
    assert chunks[-1].usage.decode_worker_id != victim


def test_draining_decode_finishes_its_stream_and_takes_nothing_new(cluster) -> None:
    """Runs last: the only D left drains for good."""
    (decode,) = [s for s in cluster.services if s.role == "decode" and s.process.poll() is None]

    async def body() -> float:
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            call = stub.Generate(wire.generate_request_to_proto(PROMPTS[2], greedy(60)))
            chunks = [wire.generate_response_from_proto(await call.read()) for _ in range(2)]
            w = Workers(decode.address, decode.address)
            try:
                status = await w.decode.Drain(worker_pb2.DrainRequest(), metadata=METADATA)
                assert status.num_running_requests == 1
                while (reply := await call.read()) is not grpc.aio.EOF:
                    chunks.append(wire.generate_response_from_proto(reply))
                assert chunks[-1].finish_reason is FinishReason.LENGTH
                assert sum(len(c.token_ids) for c in chunks) == 60
                started_s = time.monotonic()
                refused = await generate(channel, PROMPTS[0], greedy(4), timeout_s=20)
                assert refused.code is grpc.StatusCode.UNAVAILABLE, refused
                refused_s = time.monotonic() - started_s
                status = await w.decode.Drain(worker_pb2.DrainRequest(), metadata=METADATA)
                assert status.num_running_requests == 0
            finally:
                await w.close()
        await assert_no_worker_leaks(cluster)
        return refused_s

    refused_s = run(body())
    print(f"drain: a new request was refused in {refused_s:.2f} s")
    assert refused_s < 5.0
