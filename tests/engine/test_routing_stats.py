"""Per-layer expert popularity counted on the device (`dsv4.runner.routing_stats`): exact against
a host recount of the router's own output, on the paged forward (eager steps and static decode
passes with padding rows, which must not count) and the reference forward."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from dsv4.config.model import tiny_config
from dsv4.model.tiny import random_model
from dsv4.runner.paged.decode_graphs import GraphOptions
from dsv4.runner.paged.graphs import StaticPass
from dsv4.serving.expert_metrics import ExpertSelectionCollector, top_share
from tests.engine.conftest import greedy_request, make_core, run_to_completion
from tests.leak import assert_no_leaks

STATIC = GraphOptions(max_batch=4, max_model_len=2048, capture=False)
PROMPTS = {
    "a": list(range(3, 43)),
    "b": [7, 1, 9, 400, 2, 11, 13, 5, 8],
    "c": list(range(900, 917)),
}


class RouteRecorder:
    """Keeps the real rows of every routing call's ids [T, K]: all rows of an eager step, the
    first len(rows) * q of a static pass (the rest are its padding rows)."""

    def __init__(self, core, num_layers: int, num_experts: int) -> None:
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        self.num_calls = self.num_padding_rows = 0
        self._real_rows: int | None = None
        flat = core.runner.forward.paged
        flat._route, flat._hash_route = self._wrap(flat._route), self._wrap(flat._hash_route)
        graphs = core.runner.forward.graphs
        if graphs is not None:
            target = graphs.passes["target"]
            target.run = self._wrap_run(target, target.run)

    def _wrap(self, route):
        def recorded(*args):
            weights, ids = route(*args)
            n = ids.shape[0] if self._real_rows is None else self._real_rows
            layer = self.num_calls % self.counts.shape[0]  # one call per layer, in order
            self.counts[layer] += torch.bincount(
                ids[:n].reshape(-1), minlength=self.counts.shape[1]
            )
            self.num_padding_rows += ids.shape[0] - n
            self.num_calls += 1
            return weights, ids

        return recorded

    def _wrap_run(self, static: StaticPass, run):
        def recorded(key, rows, *args, **kwargs):
            self._real_rows = len(rows) * static.inputs.query_len
            try:
                return run(key, rows, *args, **kwargs)
            finally:
                self._real_rows = None

        return recorded


def serve(core, new_tokens: int = 6) -> None:
    for rid, prompt in PROMPTS.items():
        core.add_request(greedy_request(rid, prompt, new_tokens))
    run_to_completion(core)
    assert_no_leaks(core)


def test_paged_counts_equal_a_host_recount_without_padding_rows(tiny) -> None:
    """Three requests decode in batch bucket 4 (one padding row per static step); the prefill
    steps run eagerly in chunks of 64 tokens."""
    core = make_core(tiny, budget=64, paged={}, graphs=STATIC, routing_stats=True)
    stats = core.runner.routing_stats
    cfg = tiny.cfg
    assert stats.counts.shape == (cfg.num_hidden_layers, cfg.n_routed_experts)  # no MTP layer
    assert stats.snapshot() == [[0] * cfg.n_routed_experts] * cfg.num_hidden_layers  # capture
    recorder = RouteRecorder(core, cfg.num_hidden_layers, cfg.n_routed_experts)
    serve(core)
    assert core.runner.forward.graphs.passes["target"].num_runs > 0
    assert recorder.num_padding_rows > 0
    assert torch.equal(stats.counts, recorder.counts)
    tokens = sum(len(p) for p in PROMPTS.values()) + len(PROMPTS) * (6 - 1)
    assert (
        stats.counts.sum(1).tolist() == [tokens * cfg.num_experts_per_tok] * cfg.num_hidden_layers
    )


def test_reference_forward_counts_through_the_installed_observer(tiny) -> None:
    core = make_core(tiny, routing_stats=True)
    stats = core.runner.routing_stats
    seen: list[torch.Tensor] = []
    moe = tiny.layers[1].ffn
    count = moe.route_observer
    moe.route_observer = lambda ids: (seen.append(ids.clone()), count(ids))
    try:
        serve(core)
    finally:
        moe.route_observer = None
        for block in tiny.layers:  # the fixture is shared: leave no observer behind
            block.ffn.route_observer = None
    recount = torch.bincount(torch.cat(seen).reshape(-1), minlength=tiny.cfg.n_routed_experts)
    assert torch.equal(stats.counts[1], recount)
    assert stats.counts.sum().item() > 0
    stats.reset()
    assert stats.counts.sum().item() == 0


def test_counts_export_per_layer_not_per_expert() -> None:
    counts = [[5, 0, 0, 0, 0, 0, 0, 0, 0, 5], [1] * 10, [0] * 10]
    registry = CollectorRegistry()
    registry.register(ExpertSelectionCollector(lambda: counts, num_main_layers=2))
    total = {s.labels["layer"]: s.value for s in registry.collect() for s in s.samples
             if s.name == "dsv4_expert_selections_total"}  # fmt: skip
    share = {s.labels["layer"]: s.value for s in registry.collect() for s in s.samples
             if s.name == "dsv4_expert_top_share"}  # fmt: skip
    assert total == {"0": 10.0, "1": 10.0, "mtp": 0.0}
    assert share == {"0": 0.5, "1": 0.1, "mtp": 0.0}
    assert top_share([3, 1, 0, 0], fraction=0.5) == 1.0


def test_paged_mtp_passes_count_in_the_last_row() -> None:
    """With MTP (k = 1) the MTP layer's routing, in its static passes too, is the last row."""
    model = random_model(tiny_config(), seed=3)
    core = make_core(model, budget=64, paged={}, graphs=STATIC, spec_tokens=1, max_num_seqs=8,
                     routing_stats=True)  # fmt: skip
    stats = core.runner.routing_stats
    assert stats.counts.shape[0] == model.cfg.num_hidden_layers + 1
    assert stats.counts.sum().item() == 0  # every captured pass ran on padding rows only
    serve(core)
    k = model.cfg.num_experts_per_tok
    mtp = stats.counts[-1].sum().item()
    assert mtp > 0 and mtp % k == 0
    assert core.runner.forward.graphs.passes["mtp"].num_runs > 0


@pytest.mark.gpu
def test_captured_graphs_count_only_real_rows_on_the_gpu() -> None:
    """CUDA graphs for real (Triton kernels): with replays, as eagerly, every layer counts
    exactly the real tokens x top-k (three requests in batch bucket 4: one padding row per
    replay, which must not count)."""
    from kernels.backend import KernelBackendConfig

    cfg = tiny_config().with_overrides(num_nextn_predict_layers=0)
    model = random_model(cfg, seed=5, dtype=torch.bfloat16, device="cuda")
    kernels = KernelBackendConfig(default="triton")
    counts = []
    for graphs in (None, GraphOptions(max_batch=4, max_model_len=1024)):
        core = make_core(model, kv="fp8", index="mxfp4", budget=512, paged={}, kernels=kernels,
                         graphs=graphs, max_num_seqs=4, routing_stats=True)  # fmt: skip
        assert core.runner.routing_stats.counts.sum().item() == 0  # captures: padding only
        serve(core, new_tokens=8)
        if graphs is not None:
            assert core.runner.forward.graphs.passes["target"].num_runs >= 6
        counts.append(core.runner.routing_stats.snapshot())
    tokens = sum(len(p) for p in PROMPTS.values()) + len(PROMPTS) * (8 - 1)
    for run in counts:  # eager, graphs
        assert [sum(row) for row in run] == [tokens * cfg.num_experts_per_tok] * len(run)
