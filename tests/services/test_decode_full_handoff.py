"""A decode worker with no room refuses a hand-off and leaves P's lease alone, against real
worker processes (no router): the refusal is RESOURCE_EXHAUSTED with a retry hint, P still
holds the KV, and the same handle pulled later (the router's retry on another D) gives the
single engine's tokens without recomputing; a handle nobody retries expires by P's TTL; a
request aborted while D waits for room ends ABORT and frees P's lease. Ends
leak-free over Info: every block free, no leases.

D is sized from the workers' own layout: room for one long "filler" request, and less than a
hand-off's blocks left beside it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from worker_cluster import (
    PROMPTS,
    WORKER_ARGS,
    Workers,
    greedy,
    num_blocks_at_once,
    single_engine_outputs,
    start_cluster,
    tiny_checkpoint,
    worker_kv,
)

from dsv4 import wire
from dsv4.types import FinishReason, GenerateRequest, PullFailurePolicy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
LEASE_TTL_S = 5.0  # room for refuse -> free D -> retry before P's lease expires
FILLER = [(7 * i) % 997 + 2 for i in range(600)]
FILLER_NEW_TOKENS = 400  # decodes for seconds: D stays full until the test aborts it
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return tiny_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache")


def test_refused_handoff_keeps_the_lease_for_a_retry_or_its_ttl(model_dir) -> None:
    layout, _ = worker_kv(model_dir, WORKER_ARGS)
    num_blocks = num_blocks_at_once(layout, [FILLER], FILLER_NEW_TOKENS)  # the filler alone
    handoff_blocks = layout.num_blocks_for_request(len(PROMPTS[0]))
    assert num_blocks - layout.num_blocks_for_request(len(FILLER)) < handoff_blocks
    expected = single_engine_outputs(model_dir, [PROMPTS[0]], MAX_NEW_TOKENS)[0]
    cluster = start_cluster(
        model_dir, with_router=False,
        service_args=(*WORKER_ARGS, "--lease-ttl-s", str(LEASE_TTL_S)),  # the last flag wins
        decode_args=("--num-blocks", str(num_blocks)),
    )  # fmt: skip

    async def body(w: Workers) -> None:
        filler = GenerateRequest("filler", tuple(FILLER), greedy(FILLER_NEW_TOKENS))
        filling = asyncio.ensure_future(_read_all(w.decode_stream(filler)))  # colocated on D
        while (await w.info("decode")).num_free_blocks >= handoff_blocks:
            assert not filling.done(), "the filler ended before D was full"
            await asyncio.sleep(0.01)
        requests = [GenerateRequest(rid, tuple(PROMPTS[0]), greedy(MAX_NEW_TOKENS))
                    for rid in ("retried", "never-retried")]  # fmt: skip
        prefills = [await w.prefill_request(r) for r in requests]
        for request, prefill in zip(requests, prefills):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _read_all(w.decode_stream(request, prefill))
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "retry after" in (refused.value.details() or "")
        aborted = GenerateRequest("aborted-waiting", tuple(PROMPTS[0]), greedy(MAX_NEW_TOKENS))
        waiting = asyncio.ensure_future(
            _read_all(w.decode_stream(aborted, await w.prefill_request(aborted)))
        )
        for _ in range(100):  # its session registers at once; it waits ADOPT_WAIT_S for blocks
            if await w.abort_decode(aborted.request_id):
                break
            await asyncio.sleep(0.002)
        else:
            raise AssertionError("D never knew the waiting request")
        assert (await waiting)[-1].finish_reason is FinishReason.ABORT
        await asyncio.sleep(0.3)  # a Release D had sent in the background lands by now
        info = await w.info("prefill")
        assert info.num_leases == 2, (
            "D released P's lease when it refused for lack of room, or kept an aborted one"
        )
        assert not filling.done(), "the filler ended before the refusals were checked"

        assert await w.abort_decode("filler")
        assert (await filling)[-1].finish_reason is FinishReason.ABORT
        chunks = await _read_all(w.decode_stream(requests[0], prefills[0], PullFailurePolicy.FAIL))
        tokens = [prefills[0].first_token_id] + [t for c in chunks for t in c.token_ids]
        assert tokens == expected
        usage = chunks[-1].usage
        assert usage.kv_transfer_bytes > 0 and not usage.prefill_was_recomputed

    async def main() -> None:
        w = Workers(cluster.addresses("prefill")[0], cluster.addresses("decode")[0])
        try:
            await body(w)
            await w.wait_idle(timeout_s=LEASE_TTL_S + 5.0)  # the never-retried lease expires
        finally:
            await w.close()

    try:
        asyncio.run(asyncio.wait_for(main(), 120.0))
    finally:
        cluster.stop()


async def _read_all(stream) -> list:
    return [wire.decode_response_from_proto(m) async for m in stream]
