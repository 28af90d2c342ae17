"""A worker with `metrics.routing_stats`: the engine counts expert selections, /metrics exports
them per layer (and the offload pool's series exist), and `metrics.routing_stats_out` gets a
residency file that `dsv4 plan --routing-stats` reads."""

from __future__ import annotations

import asyncio

import pytest

from dsv4.config import load_config
from dsv4.errors import ConfigError
from dsv4.plan.residency import read_residency
from dsv4.scheduler.request import Request
from dsv4.serving.metrics import new_registry
from dsv4.types import WorkerRole
from dsv4.worker import routing_dump
from dsv4.worker.build import build_worker_runtime
from dsv4.worker.identity import WorkerIdentity, worker_metrics


def runtime_with_stats(out: str, **more):
    config = load_config({"model.path": "tiny", "cache.num_blocks": 32, "cache.block_size": 128,
                          "metrics.routing_stats": True, "metrics.routing_stats_out": out,
                          "model.random_routing": "zipf1", **more})  # fmt: skip
    return build_worker_runtime(config, with_transport=False)


def serve(runtime) -> None:
    core = runtime.engine.core  # not started: stepped here, on this thread
    for i, prompt in enumerate(([5, 6, 7, 8] * 10, [9, 3, 2])):
        core.add_request(Request(f"r{i}", tuple(prompt), max_new_tokens=4, eos_token_id=None))
    while core.has_work():
        core.step()


def test_counts_reach_metrics_and_the_dump(tmp_path) -> None:
    out = tmp_path / "stats.json"
    runtime = runtime_with_stats(str(out))
    serve(runtime)
    stats = runtime.engine.core.runner.routing_stats
    counts = stats.snapshot()
    cfg = runtime.model_config
    assert len(counts) == cfg.num_hidden_layers + 1  # the MTP layer's row (0: MTP is off)
    assert all(sum(row) > 0 for row in counts[:-1])

    registry = new_registry()
    identity = WorkerIdentity("w0", "127.0.0.1:1", WorkerRole.DECODE)
    worker_metrics(registry, runtime, identity, num_running=lambda: 0,
                   is_draining=lambda: False)  # fmt: skip
    value = registry.get_sample_value
    assert value("dsv4_expert_selections_total", {"layer": "1"}) == sum(counts[1])
    assert value("dsv4_expert_selections_total", {"layer": "mtp"}) == 0
    assert 0.1 < value("dsv4_expert_top_share", {"layer": "2"}) <= 1
    assert value("dsv4_expert_hit_rate") is None  # offload series: offloading workers only

    routing_dump.dump_routing_stats(runtime)
    residency = read_residency(out, cfg.num_hidden_layers + 1, cfg.n_routed_experts)
    assert [list(row) for row in residency.counts] == counts
    assert residency.num_resident == cfg.n_routed_experts


def test_the_owned_task_dumps_every_interval(tmp_path) -> None:
    out = tmp_path / "stats.json"
    runtime = runtime_with_stats(str(out), **{"metrics.routing_stats_interval_s": 1})
    serve(runtime)

    async def one_interval() -> None:
        task = routing_dump.start_dumps(runtime)
        assert task is not None
        await asyncio.sleep(1.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(one_interval())
    assert sum(map(sum, read_residency(out).counts)) > 0


def test_dumps_need_counting_and_skew_needs_random_weights() -> None:
    with pytest.raises(ConfigError, match="routing_stats_out"):
        load_config({"metrics.routing_stats_out": "/tmp/x.json"})
    with pytest.raises(ConfigError, match="random_routing"):
        load_config({"model.path": "/ckpt/flash", "model.random_routing": "zipf1"})
