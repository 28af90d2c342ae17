"""`dsv4 up`'s cluster (router + P + D processes) with expert offload: the workers get
`--device-memory-gib` (a budget that leaves room for only part of the routed experts) and
`--host-memory-gib`, as `dsv4 up ... --host-memory-gib N` passes them on. Greedy output through
the router equals the single engine without offload, and both workers export the offload's
counters (experts were fetched from host memory)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from e2e_cluster import assert_no_worker_leaks, generate, greedy

from dsv4.commands.cluster import AUTO_PORTS, free_port
from dsv4.config import load_config
from dsv4.serving.metrics import scrape
from dsv4.worker.build import planned_model_config
from dsv4.worker.fit import GIB, startup_plan
from tests.services.worker_cluster import (
    PROMPTS,
    WORKER_ARGS,
    single_engine_outputs,
    start_cluster,
    tiny_checkpoint,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
MAX_NEW_TOKENS = 6
# bf16 weights pinned: auto would hold the checkpoint's MXFP4 / FP8, which fit the budget whole
PLANNED = {"model.device": "cpu", "model.max_model_len": 512,
           "scheduler.max_num_batched_tokens": 2048, "cache.block_size": 128,
           "cache.kv_dtype": "bf16", "features.expert_weights": "bf16",
           "features.linear_weights": "bf16"}  # fmt: skip
FLAGS = ("--device", "cpu", "--max-model-len", "512", "--kv-dtype", "bf16",
         "--expert-weights", "bf16", "--linear-weights", "bf16")  # fmt: skip


def device_budget_gib(model_dir) -> float:
    """A device budget that holds all but ~3 experts per layer beyond the 2 cache slots."""
    config = load_config({**PLANNED, "model.path": str(model_dir)})
    plan = startup_plan(config, planned_model_config(config), 1 << 40)
    short = 2.5 * plan.num_moe_layers * plan.expert_bytes
    return (plan.needed_bytes - short) / plan.request.memory_fraction / GIB


def test_up_with_offload_serves_the_single_engine_tokens(tmp_path_factory) -> None:
    model_dir = tiny_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache")
    budget = device_budget_gib(model_dir)
    offload = ("--device-memory-gib", f"{budget:.6f}", "--host-memory-gib", "1")
    cluster = start_cluster(
        model_dir, router_port=free_port(), metrics_base_port=AUTO_PORTS,
        service_args=(*WORKER_ARGS, *FLAGS, *offload),
    )  # fmt: skip
    try:
        expected = single_engine_outputs(model_dir, PROMPTS, MAX_NEW_TOKENS)

        async def body() -> list[list[int]]:
            async with grpc.aio.insecure_channel(cluster.router_address) as channel:
                outcomes = await asyncio.gather(
                    *(generate(channel, p, greedy(MAX_NEW_TOKENS)) for p in PROMPTS)
                )
            await assert_no_worker_leaks(cluster)
            return [o.token_ids for o in outcomes]

        assert asyncio.run(asyncio.wait_for(body(), 90)) == expected
        for name in ("prefill-0", "decode-0"):
            metrics = scrape(cluster.service(name).metrics_url)
            assert metrics["dsv4_expert_fetches_total"] > 0, name
            assert metrics["dsv4_expert_bytes_fetched_total"] > 0, name
            assert 0 < metrics["dsv4_expert_hit_rate"] < 1, name
    finally:
        cluster.stop()
