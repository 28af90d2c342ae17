"""Prefill and decode worker processes, called directly (no router): the KV hand-off over real
NIXL gives the single engine's tokens, pull failures recompute or fail by policy, colocated
decode, leases (Release, expiry), Abort mid-stream, and every test ends leak-free over Info."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Coroutine
from typing import Any

import grpc
import pytest
from worker_cluster import (
    LEASE_TTL_S,
    METADATA,
    PROMPTS,
    Workers,
    greedy,
    single_engine_outputs,
    start_cluster,
    tiny_checkpoint,
)

from dsv4 import wire
from dsv4.rpc.v1 import worker_pb2
from dsv4.types import FinishReason, GenerateRequest, PullFailurePolicy, TransportKind

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
MAX_NEW_TOKENS = 8


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = 60.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return tiny_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache")


@pytest.fixture(scope="module")
def cluster(model_dir):
    cluster = start_cluster(model_dir, with_router=False)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def expected(model_dir) -> list[list[int]]:
    return single_engine_outputs(model_dir, PROMPTS, MAX_NEW_TOKENS)


def with_workers(cluster, body) -> Any:
    async def main() -> Any:
        workers = Workers(cluster.addresses("prefill")[0], cluster.addresses("decode")[0])
        try:
            result = await body(workers)
            await workers.wait_idle()
            return result
        finally:
            await workers.close()

    return run(main())


def request(rid: str, prompt, max_new_tokens: int = MAX_NEW_TOKENS) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), greedy(max_new_tokens))


def test_disaggregated_greedy_equals_single_engine(cluster, expected) -> None:
    async def body(w: Workers):
        runs = [w.generate(request(f"eq-{i}", p)) for i, p in enumerate(PROMPTS)]
        return await asyncio.gather(*runs)

    results = with_workers(cluster, body)
    assert [tokens for tokens, _ in results] == expected
    for tokens, chunks in results:
        assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
        last = chunks[-1]
        assert last.finish_reason is FinishReason.LENGTH
        assert last.usage.kv_transfer_bytes > 0 and not last.usage.prefill_was_recomputed
        assert last.usage.completion_tokens == len(tokens) == MAX_NEW_TOKENS
        assert sum(bool(c.token_ids) for c in chunks) >= 2  # streamed, not one final message


def test_handle_describes_a_nixl_pull_from_this_prefill_worker(cluster) -> None:
    async def body(w: Workers):
        prefill = await w.prefill_request(request("handle", PROMPTS[0]))
        info = await w.info("prefill")
        assert info.num_leases == 1 and info.num_free_blocks < info.num_total_blocks
        handle = prefill.handle
        assert handle.transport_kind is TransportKind.NIXL
        assert handle.prefill_address == cluster.addresses("prefill")[0]
        assert handle.layout_hash == info.layout_hash and handle.num_tokens == len(PROMPTS[0])
        released = await w.prefill.Release(
            worker_pb2.ReleaseRequest(lease_id=handle.lease_id, request_id="handle"),
            metadata=METADATA,
        )
        assert released.was_found and released.num_freed_blocks == len(handle.block_ids)

    with_workers(cluster, body)


@pytest.mark.parametrize("policy", [PullFailurePolicy.RECOMPUTE, PullFailurePolicy.FAIL])
def test_failed_pull_recomputes_or_fails_by_policy(cluster, expected, policy) -> None:
    async def body(w: Workers):
        req = request(f"lost-{policy.value}", PROMPTS[1])
        prefill = await w.prefill_request(req)
        await w.prefill.Release(
            worker_pb2.ReleaseRequest(lease_id=prefill.handle.lease_id), metadata=METADATA
        )  # P forgets the KV: D's pull must fail its lease check
        stream = w.decode_stream(req, prefill, policy)
        if policy is PullFailurePolicy.FAIL:
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                [m async for m in stream]
            assert failure.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "pull" in failure.value.details()
            return None
        chunks = [wire.decode_response_from_proto(m) async for m in stream]
        assert chunks[-1].usage.prefill_was_recomputed
        return [prefill.first_token_id] + [t for c in chunks for t in c.token_ids]

    tokens = with_workers(cluster, body)
    if policy is PullFailurePolicy.RECOMPUTE:
        assert tokens == expected[1]


def test_recompute_of_an_unseeded_sampled_request_continues_after_the_first_token(cluster):
    """The local run may draw another first token: the stream still has exactly
    max_new_tokens tokens, P's first token first, and nothing is re-sent."""

    async def body(w: Workers):
        sampling = dataclasses.replace(greedy(MAX_NEW_TOKENS), temperature=5.0)
        for i in range(3):
            req = GenerateRequest(f"sampled-{i}", tuple(PROMPTS[0]), sampling)
            prefill = await w.prefill_request(req)
            await w.prefill.Release(
                worker_pb2.ReleaseRequest(lease_id=prefill.handle.lease_id), metadata=METADATA
            )
            chunks = [
                wire.decode_response_from_proto(m) async for m in w.decode_stream(req, prefill)
            ]
            assert chunks[-1].usage.prefill_was_recomputed
            assert 1 + sum(len(c.token_ids) for c in chunks) == MAX_NEW_TOKENS

    with_workers(cluster, body)


def test_colocated_decode_prefills_locally(cluster, expected) -> None:
    async def body(w: Workers):
        stream = w.decode_stream(request("colo", PROMPTS[2]))
        chunks = [wire.decode_response_from_proto(m) async for m in stream]
        return [t for c in chunks for t in c.token_ids]

    assert with_workers(cluster, body) == expected[2]


def test_abort_mid_stream_frees_blocks_on_both_workers(cluster) -> None:
    async def body(w: Workers):
        req = request("abort-me", PROMPTS[1], max_new_tokens=400)
        prefill = await w.prefill_request(req)
        stream = w.decode_stream(req, prefill)
        chunks = []
        async for msg in stream:
            chunks.append(wire.decode_response_from_proto(msg))
            if len(chunks) == 2:
                assert await w.abort_decode("abort-me")
        assert chunks[-1].finish_reason is FinishReason.ABORT
        assert sum(len(c.token_ids) for c in chunks) < 399

    with_workers(cluster, body)


def test_client_cancel_mid_stream_frees_blocks(cluster) -> None:
    async def body(w: Workers):
        req = request("cancel-me", PROMPTS[0], max_new_tokens=400)
        prefill = await w.prefill_request(req)
        stream = w.decode_stream(req, prefill)
        await stream.read()
        stream.cancel()

    with_workers(cluster, body)


def test_cancel_at_any_moment_of_decode_frees_blocks(cluster) -> None:
    """The client may leave while D adopts blocks, pulls or is about to activate: whatever the
    moment, D frees the adopted blocks (wait_idle checks Info: all free, nothing running)."""

    async def body(w: Workers):
        for i, delay_s in enumerate((0.0, 0.001, 0.003, 0.01, 0.03, 0.1)):
            req = request(f"cancel-at-{i}", PROMPTS[i % len(PROMPTS)], max_new_tokens=400)
            prefill = await w.prefill_request(req)
            stream = w.decode_stream(req, prefill)
            await asyncio.sleep(delay_s)
            stream.cancel()

    with_workers(cluster, body)


def test_unpulled_lease_expires_and_frees_prefill_blocks(cluster) -> None:
    async def body(w: Workers):
        await w.prefill_request(request("never-pulled", PROMPTS[1]))
        assert (await w.info("prefill")).num_leases == 1
        await asyncio.sleep(LEASE_TTL_S + 0.5)

    with_workers(cluster, body)


@pytest.mark.parametrize(
    ("prompt", "sampling", "fix"),
    [
        ([], {}, "prompt is empty"),
        ([5, 99999], {}, "outside the vocabulary"),
        (list(range(5000)), {}, "max_model_len"),
        ([5, 6], {"temperature": -1.0}, "temperature"),
        ([5, 6], {"top_p": 0.0}, "top_p"),
        ([5, 6], {"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_bad_requests_are_invalid_argument_on_both_workers(cluster, prompt, sampling, fix) -> None:
    async def body(w: Workers):
        msg = wire.prefill_request_to_proto(request("bad", [5]))
        msg.request.ClearField("prompt_token_ids")
        msg.request.prompt_token_ids.extend(prompt)
        for name, value in sampling.items():
            setattr(msg.request.sampling, name, value)
        for call in (
            w.prefill.Prefill(msg, metadata=METADATA),
            w.decode.Decode(
                worker_pb2.DecodeRequest(request=msg.request), metadata=METADATA
            ).read(),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await call
            assert failure.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert fix in failure.value.details()

    with_workers(cluster, body)


def test_unauthenticated_calls_are_refused_but_health_is_open(cluster) -> None:
    async def body(w: Workers):
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        for call in (
            w.prefill.Info(worker_pb2.InfoRequest()),
            w.decode.Info(worker_pb2.InfoRequest(), metadata=(("x-dsv4-token", "wrong"),)),
            w.decode.Decode(worker_pb2.DecodeRequest()).read(),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await call
            assert failure.value.code() is grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(w.prefill_channel)
        answer = await health.Check(health_pb2.HealthCheckRequest())
        assert answer.status == health_pb2.HealthCheckResponse.SERVING

    with_workers(cluster, body)


def test_first_token_that_ends_the_request_needs_no_pull(cluster) -> None:
    async def body(w: Workers):
        req = dataclasses.replace(request("one", PROMPTS[0]), sampling=greedy(1))
        prefill = await w.prefill_request(req)
        chunks = [wire.decode_response_from_proto(m) async for m in w.decode_stream(req, prefill)]
        assert len(chunks) == 1 and chunks[0].token_ids == ()
        assert chunks[0].finish_reason is FinishReason.LENGTH
        assert chunks[0].usage.kv_transfer_bytes == 0

    with_workers(cluster, body)


def test_drain_refuses_new_work_and_reports_what_is_left(cluster) -> None:
    """Runs last: a drained worker stays drained."""

    async def body(w: Workers):
        for stub in (w.prefill, w.decode):
            status = await stub.Drain(worker_pb2.DrainRequest(), metadata=METADATA)
            assert status.num_running_requests == 0 and status.num_leases == 0
        assert (await w.info("prefill")).is_draining and (await w.info("decode")).is_draining
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await w.prefill_request(request("late", PROMPTS[0]))
        assert failure.value.code() is grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await w.decode_stream(request("late", PROMPTS[0])).read()
        assert failure.value.code() is grpc.StatusCode.UNAVAILABLE

    with_workers(cluster, body)
