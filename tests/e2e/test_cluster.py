"""End to end through the router: a real cluster (router + 2 prefill + 1 decode processes, KV
over real NIXL). Greedy output equals the single engine for token and text prompts; bad input,
admission, no worker, deadline, cancel and abort get their status; 200 concurrent streams; a
killed P is retried on the other P; a killed D ends the stream UNAVAILABLE within seconds.
Each test ends with the leak check over every worker's Info. The kill tests run last."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import grpc
import pytest
from e2e_cluster import (
    ExtraRouter,
    Outcome,
    assert_no_worker_leaks,
    generate,
    greedy,
    kill,
)

from dsv4.commands.cluster import free_port
from dsv4.rpc.v1 import common_pb2, router_pb2_grpc
from dsv4.text.tokenizer import TextCodec
from dsv4.types import FinishReason, SamplingParams
from tests.services.worker_cluster import (
    PROMPTS,
    WORKER_ARGS,
    single_engine_outputs,
    start_cluster,
    tiny_checkpoint,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
MAX_NEW_TOKENS = 8
TEXTS = ["The quick brown fox jumps over the lazy dog", "Readability counts."]
E2E_ARGS = (*WORKER_ARGS, "--num-blocks", "1600", "--max-num-seqs", "256")


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = 90.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return tiny_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache")


@pytest.fixture(scope="module")
def cluster(model_dir):
    cluster = start_cluster(
        model_dir, num_prefill=2, router_port=free_port(), service_args=E2E_ARGS
    )
    yield cluster
    cluster.stop()


def on_router(cluster, body) -> Any:
    async def main() -> Any:
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            result = await body(channel)
        await assert_no_worker_leaks(cluster)
        return result

    return run(main())


def test_greedy_output_equals_single_engine_for_token_and_text_prompts(cluster, model_dir) -> None:
    codec = TextCodec.from_dir(model_dir)
    encoded = [codec.encode(text) for text in TEXTS]
    expected = single_engine_outputs(model_dir, PROMPTS + encoded, MAX_NEW_TOKENS)

    async def body(channel) -> list[Outcome]:
        prompts = [*PROMPTS, *TEXTS]
        return await asyncio.gather(
            *(generate(channel, p, greedy(MAX_NEW_TOKENS)) for p in prompts)
        )

    outcomes = on_router(cluster, body)
    assert [o.code for o in outcomes] == [grpc.StatusCode.OK] * len(outcomes)
    assert [o.token_ids for o in outcomes] == expected
    for outcome, prompt in zip(outcomes, PROMPTS + encoded):
        first, last = outcome.chunks[0], outcome.chunks[-1]
        assert len(first.token_ids) == 1 and first.finish_reason is None  # P's token at once
        assert all(c.finish_reason is None for c in outcome.chunks[:-1])
        assert last.finish_reason is FinishReason.LENGTH
        assert last.usage.prompt_tokens == len(prompt)
        assert last.usage.completion_tokens == MAX_NEW_TOKENS
        assert last.usage.kv_transfer_bytes > 0
        assert outcome.text == codec.decode(outcome.token_ids)


@pytest.mark.parametrize(
    ("prompt", "sampling", "fix"),
    [
        ([], None, "empty"),
        ("", None, "empty"),
        ([5, 1 << 20], None, "outside the vocabulary"),
        (list(range(3, 4200)), None, "max_model_len"),
        ([5, 6], SamplingParams(temperature=-0.5), "temperature"),
        ([5, 6], SamplingParams(top_p=1.5), "top_p"),
        ([5, 6], SamplingParams(top_k=-2), "top_k"),
        ([5, 6], SamplingParams(max_new_tokens=0), "max_new_tokens"),
    ],
)
def test_bad_input_is_invalid_argument(cluster, prompt, sampling, fix) -> None:
    outcome = on_router(cluster, lambda channel: generate(channel, prompt, sampling))
    assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert fix in outcome.details


def test_deadline_cancel_and_abort(cluster) -> None:
    async def body(channel):
        late = await generate(channel, PROMPTS[1], greedy(400), timeout_s=0.5)
        assert late.code is grpc.StatusCode.DEADLINE_EXCEEDED
        stub = router_pb2_grpc.RouterStub(channel)
        from dsv4 import wire

        call = stub.Generate(wire.generate_request_to_proto(PROMPTS[0], greedy(400)))
        await call.read()
        call.cancel()
        assert call.cancelled() and (await call.code()) is grpc.StatusCode.CANCELLED
        aborted = asyncio.create_task(generate(channel, PROMPTS[0], greedy(400), request_id="ab-1"))
        while not (await stub.Abort(common_pb2.AbortRequest(request_id="ab-1"))).was_found:
            await asyncio.sleep(0.05)
        outcome = await aborted
        assert outcome.code is grpc.StatusCode.OK
        assert outcome.chunks[-1].finish_reason is FinishReason.ABORT

    on_router(cluster, body)


def test_200_concurrent_streams_complete_without_errors(cluster) -> None:
    async def body(channel) -> list[Outcome]:
        prompts = [[(7 * i + j) % 1000 + 2 for j in range(4 + i % 13)] for i in range(200)]
        return await asyncio.gather(*(generate(channel, p, greedy(4)) for p in prompts))

    outcomes = on_router(cluster, body)
    failed = [(o.code, o.details) for o in outcomes if o.code is not grpc.StatusCode.OK]
    assert not failed, failed[:5]
    assert all(len(o.token_ids) == 4 for o in outcomes)


def test_admission_full_and_no_healthy_worker(cluster, model_dir) -> None:
    full = ExtraRouter(
        str(model_dir), cluster.addresses("prefill"), cluster.addresses("decode"),
        "--max-inflight-requests", "1",
    )  # fmt: skip
    nowhere = ExtraRouter(
        str(model_dir), [f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]
    )
    try:
        full.wait_ready()
        nowhere.wait_ready(health_name="")

        async def body(channel):
            async with grpc.aio.insecure_channel(full.address) as to_full:
                busy = asyncio.create_task(generate(to_full, PROMPTS[0], greedy(200)))
                await asyncio.sleep(0.5)
                refused = await generate(to_full, PROMPTS[0], greedy(4))
                busy.cancel()
                await asyncio.gather(busy, return_exceptions=True)
            async with grpc.aio.insecure_channel(nowhere.address) as to_nowhere:
                unrouted = await generate(to_nowhere, PROMPTS[0], greedy(4), timeout_s=20)
            return refused, unrouted

        refused, unrouted = on_router(cluster, body)
        assert refused.code is grpc.StatusCode.RESOURCE_EXHAUSTED, refused
        assert unrouted.code is grpc.StatusCode.UNAVAILABLE, unrouted
    finally:
        full.stop()
        nowhere.stop()


def test_killed_prefill_worker_is_retried_on_the_other(cluster) -> None:
    long_prompt = [(11 * i) % 1000 + 2 for i in range(2000)]  # prefill long enough to kill it

    async def body(channel):

        from tests.services.worker_cluster import Workers

        task = asyncio.create_task(generate(channel, long_prompt, greedy(4)))
        names = ["prefill-0", "prefill-1"]
        victim = None
        while victim is None and not task.done():
            for name in names:
                workers = Workers(cluster.service(name).address, cluster.addresses("decode")[0])
                try:
                    if (await workers.info("prefill")).num_running_requests:
                        victim = name
                finally:
                    await workers.close()
            await asyncio.sleep(0.01)
        assert victim is not None, "the prefill finished before it could be killed"
        kill(cluster, victim)
        return await task

    outcome = on_router(cluster, body)
    assert outcome.code is grpc.StatusCode.OK, outcome
    assert len(outcome.token_ids) == 4
    assert outcome.chunks[-1].usage.num_prefill_retries >= 1


def test_killed_decode_worker_ends_the_stream_unavailable_within_seconds(cluster) -> None:
    async def body(channel):
        stub = router_pb2_grpc.RouterStub(channel)
        from dsv4 import wire

        call = stub.Generate(wire.generate_request_to_proto(PROMPTS[0], greedy(1000)), timeout=60)
        for _ in range(3):
            await call.read()
        killed_at = time.monotonic()
        kill(cluster, "decode-0")
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            while await call.read() is not grpc.aio.EOF:
                pass
        return failure.value.code(), time.monotonic() - killed_at

    code, seconds = on_router(cluster, body)
    assert code is grpc.StatusCode.UNAVAILABLE
    assert seconds < 10.0
