"""Issue 20's reproduction of load-dependent outputs, against a real cluster (`dsv4 up`'s
`LocalCluster`: router, prefill and decode processes, NIXL hand-off) on the full tiny model with
the served CPU formats (bf16 KV, MXFP4 indexer keys): at `--max-num-batched-tokens 50` a
129-token prompt, alone and beside others, gets the tokens one engine gives at the default
budget (16384). The workers get room for all four requests at once (`num_blocks_at_once`):
with the shared 48 blocks D sometimes refused a hand-off (RESOURCE_EXHAUSTED after the first
token), depending on how far the others had decoded."""

from __future__ import annotations

import asyncio

import grpc

from dsv4.commands.cluster import free_port
from dsv4.commands.tiny_checkpoint import ensure_tiny_checkpoint
from tests.e2e.e2e_cluster import assert_no_worker_leaks, generate, greedy, log_tails
from tests.engine.test_chunk_invariance import lossy_prompts
from tests.model.test_served_vs_transformers import NEW_TOKENS, served_tokens
from tests.services.worker_cluster import (
    WORKER_ARGS,
    Workers,
    num_blocks_at_once,
    start_cluster,
    worker_kv,
)

NUM_BLOCKS = 64  # the four requests at once need 59 on the full tiny model (asserted below)
# after WORKER_ARGS: the last flag wins
CHUNKED = ("--max-num-batched-tokens", "50", "--max-num-seqs", "8", "--num-blocks", str(NUM_BLOCKS))


def test_cluster_at_budget_50_serves_the_default_budget_tokens(tmp_path_factory) -> None:
    model_dir = ensure_tiny_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache", "")
    prompts = lossy_prompts(1024)  # 129, 1, 33, 260 tokens
    expected = served_tokens(str(model_dir), prompts)  # one engine, default budget
    service_args = (*WORKER_ARGS, *CHUNKED)
    layout, num_blocks = worker_kv(model_dir, service_args)
    needed = num_blocks_at_once(layout, prompts, NEW_TOKENS)
    assert num_blocks == NUM_BLOCKS >= needed, f"{needed} blocks at once: raise NUM_BLOCKS"
    cluster = start_cluster(model_dir, router_port=free_port(), service_args=service_args)
    sampling = greedy(NEW_TOKENS)

    async def main() -> None:
        workers = Workers(cluster.service("prefill-0").address, cluster.service("decode-0").address)
        try:  # the workers took the override
            sizes = [(await workers.info(role)).num_total_blocks for role in ("prefill", "decode")]
        finally:
            await workers.close()
        assert sizes == [NUM_BLOCKS, NUM_BLOCKS]
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            alone = await generate(channel, prompts[0], sampling)
            together = await asyncio.gather(*(generate(channel, p, sampling) for p in prompts))
            assert alone.code == grpc.StatusCode.OK, alone.details
            assert alone.token_ids == expected[0]
            endings = [o.ending for o in together]
            assert endings == ["OK/LENGTH"] * len(prompts), f"{endings}\n{log_tails(cluster)}"
            assert [o.token_ids for o in together] == expected, log_tails(cluster)
        await assert_no_worker_leaks(cluster)

    try:
        asyncio.run(main())
    finally:
        cluster.stop()
