"""A burst larger than the decode pool's KV, through a real cluster (router, prefill and decode
processes, NIXL hand-off): D holds one request's blocks, four arrive at once. D refuses the
others as full; the router tries again while P's lease lasts (router.decode_full_wait_s), and
every request ends OK with the tokens one engine gives them alone. Before, the refused requests
ended RESOURCE_EXHAUSTED after their first token: the outcome depended on the load."""

from __future__ import annotations

import asyncio

import grpc

from dsv4.commands.cluster import free_port
from dsv4.serving.metrics import scrape
from tests.e2e.e2e_cluster import assert_no_worker_leaks, generate, greedy, log_tails
from tests.services.worker_cluster import (
    NUM_BLOCKS,
    WORKER_ARGS,
    num_blocks_at_once,
    single_engine_outputs,
    start_cluster,
    tiny_checkpoint,
    worker_kv,
)

NEW_TOKENS = 96  # long enough that D stays full past its own 0.5 s wait for room
PROMPTS = [list(range(2, 150)), list(range(149, 2, -1)), list(range(300, 420)), [7] * 130]
LONG_LEASE = ("--lease-ttl-s", "30")  # the tests' 3 s lease would leave the router ~1 s


def test_a_burst_beyond_the_decode_kv_waits_and_gets_the_single_engine_tokens(
    tmp_path_factory,
) -> None:
    model_dir = tiny_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache")
    layout, _ = worker_kv(model_dir, WORKER_ARGS)
    one = max(num_blocks_at_once(layout, [p], NEW_TOKENS) for p in PROMPTS)
    all_at_once = num_blocks_at_once(layout, PROMPTS, NEW_TOKENS)
    assert one < all_at_once <= NUM_BLOCKS  # D below: full; P and the baseline above: never
    expected = single_engine_outputs(model_dir, PROMPTS, NEW_TOKENS)
    cluster = start_cluster(
        model_dir,
        router_port=free_port(),
        service_args=(*WORKER_ARGS, *LONG_LEASE),
        decode_args=("--num-blocks", str(one)),
    )

    async def main() -> None:
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            sampling = greedy(NEW_TOKENS)
            outcomes = await asyncio.gather(*(generate(channel, p, sampling) for p in PROMPTS))
            endings = [o.ending for o in outcomes]
            assert endings == ["OK/LENGTH"] * len(PROMPTS), f"{endings}\n{log_tails(cluster)}"
            assert [o.token_ids for o in outcomes] == expected
        await assert_no_worker_leaks(cluster)

    try:
        asyncio.run(main())
        router = scrape(cluster.service("router").metrics_url)
        assert router["dsv4_router_decode_full_retries_total"] > 0, "D was never full"
    finally:
        cluster.stop()
