"""One bad request must not take a pool down, on a real cluster (router + 1 P + 1 D, NIXL):
sampling that cannot produce a token gets a status at once (through the router and straight
at the prefill worker) and the next request is served; a decode worker with 40 KV blocks and
five concurrent 100-token / 200-new-token requests finishes them all, preempting by
recompute, and refuses a sixth within a second with RESOURCE_EXHAUSTED, keeping P's lease of
it (the router would retry it on another D, or release it); nothing leaks."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from e2e_cluster import assert_no_worker_leaks, generate, greedy

from dsv4.commands.cluster import free_port, is_serving
from dsv4.rpc.v1 import worker_pb2
from dsv4.types import FinishReason, GenerateRequest, SamplingParams
from tests.services.worker_cluster import (
    METADATA,
    WORKER_ARGS,
    Workers,
    start_cluster,
    tiny_checkpoint,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
NUM_BLOCKS = 40  # 6 ring + 1 per 128 positions: five 100-token prompts take 35, then outgrow 40
NUM_NEW_TOKENS = 200  # the 300 shortened: past 256 positions five need 45 blocks
REPRO_IDS = [5, 9, 200, 17, 33]
DEGENERATE = (
    dict(temperature=1.0, top_p=1e-300),
    dict(temperature=1e-30),
    dict(temperature=1.0, top_p=1e-45, top_k=1),
)


def run(coro, timeout_s: float = 150.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    model_dir = tiny_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache")
    cluster = start_cluster(
        model_dir, num_prefill=1, num_decode=1, router_port=free_port(),
        # the last flag wins; info logs show D's preemptions
        service_args=(*WORKER_ARGS, "--num-blocks", str(NUM_BLOCKS), "--log-level", "info"),
    )  # fmt: skip
    yield cluster
    cluster.stop()


def test_degenerate_sampling_gets_a_status_at_once_and_the_pool_serves_on(cluster) -> None:
    async def body() -> None:
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            for sampling in DEGENERATE:
                started_s = time.monotonic()
                params = SamplingParams(max_new_tokens=4, **sampling)  # type: ignore[arg-type]
                outcome = await generate(channel, REPRO_IDS, params, timeout_s=10)
                assert time.monotonic() - started_s < 1.0
                assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT, outcome
                assert "must be at least" in outcome.details
                workers = Workers(cluster.service("prefill-0").address, "127.0.0.1:1")
                try:  # the worker re-checks what reaches it without the router
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await workers.prefill_request(GenerateRequest("direct", (5, 9), params))
                    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                finally:
                    await workers.close()
                normal = await generate(channel, REPRO_IDS, greedy(4), timeout_s=20)
                assert normal.code is grpc.StatusCode.OK and len(normal.token_ids) == 4
        for service in cluster.services:
            assert is_serving(service.address), service.name
        await assert_no_worker_leaks(cluster)

    run(body())


def test_decode_out_of_blocks_preempts_or_refuses_at_once_and_leaks_nothing(cluster) -> None:
    prompts = [[(7 * i + 31 * n) % 997 + 2 for i in range(100)] for n in range(5)]

    async def one(channel: grpc.aio.Channel, prompt: list[int]) -> tuple[float, object]:
        started_s = time.monotonic()
        outcome = await generate(channel, prompt, greedy(NUM_NEW_TOKENS), timeout_s=120)
        return time.monotonic() - started_s, outcome

    async def one_more_straight_at_the_full_decode() -> float:
        """While the five decode: prefill a sixth on P, hand it to D, which has no room."""
        workers = Workers(cluster.service("prefill-0").address, cluster.service("decode-0").address)
        try:
            while (await workers.info("decode")).num_running_requests < len(prompts):
                await asyncio.sleep(0.02)
            request = GenerateRequest("sixth", tuple(prompts[0]), greedy(NUM_NEW_TOKENS))
            prefill = await workers.prefill_request(request)
            started_s = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [m async for m in workers.decode_stream(request, prefill)]
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "retry after" in (refused.value.details() or "")
            refused_after_s = time.monotonic() - started_s
            # D left P's lease alone (another D may still pull it): release it like the router
            release = worker_pb2.ReleaseRequest(
                lease_id=prefill.handle.lease_id, request_id="sixth"
            )
            assert (await workers.prefill.Release(release, metadata=METADATA)).was_found
            return refused_after_s
        finally:
            await workers.close()

    async def body() -> list[tuple[float, object]]:
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            refusing = asyncio.ensure_future(one_more_straight_at_the_full_decode())
            results = await asyncio.gather(*(one(channel, p) for p in prompts))
            assert await refusing < 1.0
            after = await generate(channel, REPRO_IDS, greedy(4), timeout_s=20)
            assert after.code is grpc.StatusCode.OK
        await assert_no_worker_leaks(cluster)
        return results

    results = run(body())
    served = 0
    for seconds, outcome in results:
        if outcome.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert seconds < 1.5 and "retry after" in outcome.details, (seconds, outcome)
            continue
        assert outcome.code is grpc.StatusCode.OK, outcome
        assert len(outcome.token_ids) == NUM_NEW_TOKENS
        assert outcome.chunks[-1].finish_reason is FinishReason.LENGTH
        served += 1
    assert served >= 4  # at least four fit at once: they all finish (the pool preempts)
    assert "out of KV blocks" in cluster.service("decode-0").log_path.read_text()
    print(f"served {served}/5; seconds: {[round(s, 1) for s, _ in results]}")
