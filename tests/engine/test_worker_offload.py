"""A worker serves a model whose routed experts do not fit its device budget with expert
offload (issue 22): the start-up plan's K and cache slots, cold experts loaded straight into
host memory, the same greedy tokens as without offload, and a one-line refusal (before any
weight is loaded) when the host budget is too small.

The tiny model's device budget is `model.device_memory_gib` (a CPU device has no GPU total):
0.0135 GiB with a 512-token context and 256-token steps leaves room for 3 of 8 bf16 experts per
layer beside the MTP layer's weights (the plan offloads the rest, with 2 cache slots)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.runtime_tokens import runtime_greedy_tokens
from dsv4.config import load_config
from dsv4.config.model import tiny_config
from dsv4.errors import ConfigError
from dsv4.model.offload import ExpertStats
from dsv4.model.offload_load import ExpertOffload
from dsv4.model.tiny import random_model, write_checkpoint, write_model_spec
from dsv4.plan import PlanDoesNotFit
from dsv4.plan.residency import Residency, write_residency
from dsv4.worker import build
from dsv4.worker.build import build_worker_runtime
from dsv4.worker.fit import GIB, startup_plan
from dsv4.worker.offload import apply_offload, check_host_memory, read_residency
from tests.leak import assert_no_leaks

BUDGET = {
    "model.device": "cpu", "model.max_model_len": 512, "scheduler.max_num_batched_tokens": 256,
    "cache.kv_dtype": "fp32", "cache.indexer_key_dtype": "fp32", "cache.num_blocks": 16,
    "cache.block_size": 128, "scheduler.max_num_seqs": 2,
}  # fmt: skip
OFFLOAD = {"model.device_memory_gib": 0.0135, "model.host_memory_gib": 1.0}
FP4_DEVICE_GIB = 0.0128  # MXFP4 experts (a quarter of the bytes): 4 of 8 offloaded
PAGED_DEVICE_GIB = 0.014  # the paged forward's plan holds 4 slots (2 seqs x top-2) a layer
PROMPTS = ([5, 17, 300, 2, 9, 44, 1000, 3] * 5, [7, 7, 8, 900, 12])


def served_tokens(runtime) -> list[list[int]]:
    return runtime_greedy_tokens(runtime, PROMPTS, 8)


@pytest.fixture(scope="module")
def flash_like_dir(tmp_path_factory):
    """random:DIR of the tiny shape with MXFP4 experts (as V4-Flash stores them)."""
    out = tmp_path_factory.mktemp("fp4-tiny")
    write_model_spec(out, tiny_config().with_overrides(expert_dtype="fp4"))
    return out


class Allocations(TorchDispatchMode):
    """Shapes of every tensor the dispatcher creates empty (torch.empty, to_empty, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.startswith(("empty", "new_empty")) and isinstance(out, torch.Tensor):
            self.shapes.append(tuple(out.shape))
        return out


def test_offloaded_worker_serves_the_same_greedy_tokens_with_the_plans_k_and_slots(
    flash_like_dir,
) -> None:
    common = {**BUDGET, "model.path": f"random:{flash_like_dir}",
              "features.expert_weights": "checkpoint"}  # fmt: skip
    resident = build_worker_runtime(load_config(common), with_transport=False)
    assert resident.offload is None
    expected = served_tokens(resident)

    config = load_config({**common, **OFFLOAD, "model.device_memory_gib": FP4_DEVICE_GIB})
    with Allocations() as allocations:
        runtime = build_worker_runtime(config, with_transport=False)
    cfg = runtime.model_config
    plan = startup_plan(runtime.config, cfg, int(FP4_DEVICE_GIB * GIB))
    assert plan.verdict == "fits_with_offload"
    k, slots, e = plan.offloaded_per_layer, plan.cache_slots, cfg.n_routed_experts
    used = runtime.offload.offload
    assert (used.num_offloaded, used.cache_slots) == (k, slots) and 0 < k < e
    *layers, mtp = runtime.offload.stores
    assert len(layers) == cfg.num_hidden_layers == plan.num_moe_layers
    for store in layers:  # the device holds E - K resident + the slots
        assert store.resident.shape == (e - k, plan.expert_bytes)  # MXFP4 blobs, no padding
        assert store.slots.blobs.shape == (slots, plan.expert_bytes) and len(store.host) == k
    # speculative decoding is off: the MTP layer never runs, its experts all wait in host memory
    assert mtp.resident.shape[0] == 0 and len(mtp.host) == e
    device_expert_bytes = sum(s.resident.nbytes + s.slots.blobs.nbytes
                              for s in runtime.offload.stores[: cfg.num_hidden_layers])  # fmt: skip
    assert device_expert_bytes == plan.device_expert_bytes
    # no stacked storage of a whole layer's experts ([E, ...] or [E + 1, ...]) was ever made
    assert not [s for s in allocations.shapes if len(s) == 3 and s[0] in (e, e + 1)]

    assert served_tokens(runtime) == expected
    stats = runtime.offload.stats()
    assert stats.misses > 0 and stats.bytes_fetched == stats.misses * plan.expert_bytes


def test_checkpoint_dir_loads_split_with_dense_experts_and_serves_the_same_tokens(
    tmp_path,
) -> None:
    """A real checkpoint (MXFP4 experts on disk) served with bf16 experts: each expert is
    dequantised straight into its resident or host blob."""
    write_checkpoint(tmp_path, tiny_config().with_overrides(expert_dtype="fp4"), seed=5)
    common = {**BUDGET, "model.path": str(tmp_path), "features.expert_weights": "bf16"}
    expected = served_tokens(build_worker_runtime(load_config(common), with_transport=False))
    runtime = build_worker_runtime(load_config({**common, **OFFLOAD}), with_transport=False)
    store = runtime.offload.stores[0]
    assert not store.fmt.is_mxfp4 and len(store.host) == runtime.offload.offload.num_offloaded > 0
    assert served_tokens(runtime) == expected


def test_auto_weights_resolve_at_start_up_and_nothing_after_sees_auto(flash_like_dir) -> None:
    """Issue 22: weights "auto" (the default) are bf16 with no device plan (a CPU device without
    a budget) and where the bf16 plan fits; the checkpoint's MXFP4 experts where it does not."""
    path = {**BUDGET, "model.path": f"random:{flash_like_dir}"}
    for values in (path, {**path, "model.device_memory_gib": 1.0}):
        runtime = build_worker_runtime(load_config(values), with_transport=False)
        f = runtime.config.features
        assert (f.expert_weights, f.linear_weights) == ("bf16", "bf16")
        assert runtime.offload is None
    tight = load_config({**path, **OFFLOAD, "model.device_memory_gib": FP4_DEVICE_GIB})
    runtime = build_worker_runtime(tight, with_transport=False)
    f = runtime.config.features
    assert (f.expert_weights, f.linear_weights) == ("checkpoint", "bf16")  # bf16 linears stored
    assert runtime.offload.stores[0].fmt.is_mxfp4


def test_too_little_host_memory_refuses_in_one_line_before_loading(monkeypatch) -> None:
    loads = []
    monkeypatch.setattr(build, "load_weights", lambda *a, **k: loads.append(a))
    config = load_config({**BUDGET, **OFFLOAD, "model.host_memory_gib": 0.001})
    with pytest.raises(PlanDoesNotFit) as refusal:
        build_worker_runtime(config, with_transport=False)
    assert refusal.value.message == (
        "needs 2.4 MiB of pinned host memory for 5 of 8 experts x 4 layers"
        " + the unused MTP layer's; "
        "--host-memory-gib gives 0.001"
    )
    assert loads == []


def test_worker_cli_refusal_is_one_line_without_traceback() -> None:
    command = [sys.executable, "-m", "dsv4.commands.cli", "decode", "--model", "tiny",
               "--device", "cpu", "--max-model-len", "512", "--max-num-batched-tokens", "256",
               "--kv-dtype", "fp32", "--indexer-key-dtype", "fp32", "--device-memory-gib",
               "0.0133", "--host-memory-gib", "0.001", "--metrics-port", "0"]  # fmt: skip
    env = {**os.environ, "DSV4_SHARED_SECRET": "offload-test-secret"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "of pinned host memory for 6 of 8 experts x 4 layers" in lines[0]
    assert lines[0].endswith("--host-memory-gib gives 0.001")


def test_host_memory_check_refuses_more_than_the_budget_or_the_host_has() -> None:
    what = "64 of 256 experts x 43 layers"
    check_host_memory(10 * GIB, 12 * GIB, 11 * GIB, what)
    check_host_memory(10 * GIB, 12 * GIB, None, what)  # no /proc/meminfo: the budget only
    with pytest.raises(PlanDoesNotFit, match=r"^needs 10\.0 GiB of pinned host memory for 64 of "
                       r"256 experts x 43 layers; this host has 4\.0 GiB available$"):  # fmt: skip
        check_host_memory(10 * GIB, 12 * GIB, 4 * GIB, what)
    with pytest.raises(PlanDoesNotFit, match=r"; --host-memory-gib gives 8$"):
        check_host_memory(10 * GIB, 8 * GIB, 11 * GIB, what)


def test_paged_worker_with_offload_serves_the_resident_tokens_through_its_expert_pool() -> None:
    """`features.forward=paged` with offload: the split load's stores become the expert pool
    (the plan counts slots for a decode step of max_num_seqs tokens), the tokens are those of
    the same worker with every expert resident, and the pool's counters feed the metrics."""
    paged = {**BUDGET, "features.forward": "paged"}
    expected = served_tokens(build_worker_runtime(load_config(paged), with_transport=False))
    config = load_config({**paged, **OFFLOAD, "model.device_memory_gib": PAGED_DEVICE_GIB})
    runtime = build_worker_runtime(config, with_transport=False)
    cfg, served = runtime.model_config, runtime.offload
    plan = startup_plan(runtime.config, cfg, int(PAGED_DEVICE_GIB * GIB))
    assert plan.cache_slots == 2 * cfg.num_experts_per_tok and served.stores == ()
    *layers, mtp = served.pool.layers
    for layer in layers:  # E - K resident + the plan's slots, on the device
        assert layer.num_resident == cfg.n_routed_experts - plan.offloaded_per_layer
        assert layer.num_slots == min(plan.cache_slots, plan.offloaded_per_layer)
    assert mtp.num_resident == 0 and mtp.num_slots == 0  # speculation off: it never runs
    assert served_tokens(runtime) == expected
    stats = served.stats()
    assert stats.fetches > 0 and stats.bytes_fetched == stats.fetches * layers[0].row_bytes
    assert stats.copy_wait_ns > 0  # the copies of those fetches, timed (the host clock here)
    assert_no_leaks(served.pool)
    cpu = build_worker_runtime(load_config({**BUDGET, **OFFLOAD}), with_transport=False)
    assert cpu.config.features.forward == "reference" and cpu.offload.stores  # auto on CPU


def test_residency_order_picks_the_resident_experts(tmp_path) -> None:
    """The residency file `dsv4 plan --residency-out` writes decides which experts stay."""
    path = tmp_path / "residency.json"
    cfg = tiny_config()
    layers = cfg.num_hidden_layers + (1 if cfg.has_mtp else 0)
    counts = [[0] * cfg.n_routed_experts for _ in range(layers)]
    counts[0][5:8] = [1, 2, 3]  # layer 0 prefers 7, 6, 5; layer 1 prefers 1, 3, 5
    counts[1][1], counts[1][3], counts[1][5] = 9, 8, 7
    write_residency(Residency.from_counts(counts), path)
    assert read_residency(str(path), cfg)[:2] == (
        (7, 6, 5, 0, 1, 2, 3, 4),
        (1, 3, 5, 0, 2, 4, 6, 7),
    )
    config = load_config({**BUDGET, **OFFLOAD, "model.expert_residency": str(path)})
    stores = build_worker_runtime(config, with_transport=False).offload.stores  # 3 resident
    assert sorted(stores[0].resident_row) == [5, 6, 7]
    assert sorted(stores[1].resident_row) == [1, 3, 5]
    assert sorted(stores[2].resident_row) == [0, 1, 2]  # no counts: experts 0..E-1 in order
    write_residency(Residency.from_counts([row[:4] for row in counts]), path)
    with pytest.raises(ConfigError, match="num_experts 4, the model has 8"):
        build_worker_runtime(load_config({**BUDGET, **OFFLOAD, "model.expert_residency": str(path)}),
                             with_transport=False)  # fmt: skip
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"model\.expert_residency"):
        read_residency(str(path), cfg)


def test_offload_metrics_are_exported() -> None:
    from prometheus_client import CollectorRegistry

    from dsv4.serving.metrics import ExpertCollector

    registry = CollectorRegistry()
    registry.register(ExpertCollector(lambda: ExpertStats(6, 1, 3, 0, 3000)))
    assert registry.get_sample_value("dsv4_expert_hit_rate") == 0.7
    assert registry.get_sample_value("dsv4_expert_bytes_fetched_total") == 3000
    assert registry.get_sample_value("dsv4_expert_fetches_total") == 3
    assert registry.get_sample_value("dsv4_expert_cpu_computes_total") == 0
    assert registry.get_sample_value("dsv4_expert_copy_wait_seconds_total") is None  # untimed
    from dsv4.runner.paged import PoolStats  # the paged forward's pool: the same series

    pooled = CollectorRegistry()
    pooled.register(ExpertCollector(lambda: PoolStats(6, 1, 3, 3000, copy_wait_ns=2_500_000)))
    assert pooled.get_sample_value("dsv4_expert_hit_rate") == 0.7
    assert pooled.get_sample_value("dsv4_expert_cache_hit_rate") == 0.25
    assert pooled.get_sample_value("dsv4_expert_fetches_total") == 3
    assert pooled.get_sample_value("dsv4_expert_bytes_fetched_total") == 3000
    assert pooled.get_sample_value("dsv4_expert_copy_wait_seconds_total") == 0.0025


def test_apply_offload_moves_a_model_loaded_whole_like_the_split_load() -> None:
    """`apply_offload` (the one call site of the expert path) on a model whose experts were
    loaded whole gives the stores the split load builds: same residents, same logits."""
    cfg = tiny_config().with_overrides(expert_dtype="fp4")
    offload = ExpertOffload(5, 2, ((7, 6, 5),), planned_layers=cfg.num_hidden_layers)
    whole = random_model(cfg, seed=4, expert_weights="checkpoint")
    moved = apply_offload(whole, offload, "reference")
    split = random_model(cfg, seed=4, expert_weights="checkpoint", offload=offload)
    assert [sorted(s.resident_row) for s in moved.stores][:2] == [[5, 6, 7], [0, 1, 2]]
    assert len(moved.stores[-1].host) == cfg.n_routed_experts  # the MTP layer: all cold
    ids = torch.randint(0, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = whole(ids, states=[whole.new_state()]).logits
        b = split(ids, states=[split.new_state()]).logits
    assert torch.equal(a, b) and moved.stats().misses > 0


RECORD_FIELDS = {
    "name", "batch", "prompt_len", "mtp_k", "forward", "cuda_graphs", "expert_weights",
    "linear_weights", "time_us", "hit_rate", "copy_wait_us", "bytes_fetched", "copy_floor_us",
    "compute_us", "routing", "baseline_time_us", "speedup",
}  # fmt: skip


def test_offload_benchmark_runs_on_cpu_and_writes_the_record_contract(tmp_path) -> None:
    """The GPU benchmark's whole path on the tiny shape: the token check on the paged forward
    and the timing records of both forwards (a few steps)."""
    from benchmarks.offload_serve_check import main

    out = tmp_path / "offload.json"
    argv = ["--shape", "tiny", "--device", "cpu", "--batches", "2", "--steps", "1",
            "--routings", "zipf1", "--prompt-len", "8", "--ttft-prompt", "16",
            "--prefill-prompt", "24", "--new-tokens", "2", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["equal"] and result["offloaded"]["forward"] == "paged"
    records = result["records"]
    keys = {(r["name"], r["forward"], r["expert_prefetch"]) for r in records}
    prefill = [r for r in records if r["name"] == "full_depth_prefill"]
    assert all(
        r["prompt_len"] == 24 and r["tok_s"] == pytest.approx(24e6 / r["time_us"]) for r in prefill
    )
    assert keys == {(n, f, p) for n in ("full_depth_tpot", "full_depth_ttft", "full_depth_prefill")
                    for f, p in (("paged", False), ("paged", True), ("reference", False))}  # fmt: skip
    for r in records:
        assert r.keys() >= RECORD_FIELDS and r["routing"] == "zipf1" and r["time_us"] > 0
        assert r["residency"] == "popularity"  # the expected counts' hot experts stay
        assert r["copy_floor_us"] == r["bytes_fetched"] / 55e3
    paged = [r for r in records if r["forward"] == "paged"]
    assert all(r["speedup"] == r["baseline_time_us"] / r["time_us"] for r in paged)
    assert all(r["compute_us"] is not None for r in paged)  # the tiny model fits resident
    assert any(r["prefetches"] > 0 for r in paged if r["expert_prefetch"])
    assert all(r["prefetches"] == 0 for r in records if not r["expert_prefetch"])
    # measured by the pool's stamps: a step that copied its misses waited for them
    assert all(r["copy_wait_measured_us"] is None for r in records if r not in paged)
    assert all((r["copy_wait_measured_us"] > 0) == (r["bytes_fetched"] > 0)
               for r in paged if not r["expert_prefetch"])  # fmt: skip


def test_offload_benchmark_runs_the_staging_switch(tmp_path) -> None:
    """--runs paged,paged_staging: the same prompts with the prefill staging buffer on (one
    decode slot pair at batch 1, so a prefill's misses exceed the slots and go through it)."""
    from benchmarks.offload_serve_check import main

    out = tmp_path / "staging.json"
    argv = ["--shape", "tiny", "--device", "cpu", "--no-check", "--runs", "paged,paged_staging",
            "--batches", "1", "--max-seqs", "1", "--steps", "1", "--routings", "uniform",
            "--staging-experts", "4", "--prompt-len", "8", "--ttft-prompt", "16",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    records = json.loads(out.read_text())["records"]
    ttft = {r["expert_staging"]: r for r in records if r["name"] == "full_depth_ttft"}
    assert set(ttft) == {0, 4} and all(r["bytes_fetched"] > 0 for r in ttft.values())
    assert all(r["forward"] == "paged" and not r["expert_prefetch"] for r in records)


def test_offload_benchmark_times_mtp_steps_per_expected_token(tmp_path) -> None:
    """--mtp-k 2: the offloaded paged worker speculates (the MTP layer's experts in the pool
    too); TPOT is the measured spec step over 1 + the expected accepted drafts."""
    from benchmarks.offload_serve_check import main

    out = tmp_path / "mtp.json"
    argv = ["--shape", "tiny", "--device", "cpu", "--no-check", "--runs", "paged",
            "--mtp-k", "2", "--offload-share", "0.15", "--batches", "2", "--steps", "2",
            "--routings", "uniform", "--prompt-len", "8", "--ttft-prompt", "0",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    records = json.loads(out.read_text())["records"]
    tpot = [r for r in records if r["name"] == "full_depth_tpot"]
    assert len(tpot) == 1 and all(r["mtp_k"] == 2 for r in records)
    assert len(records) == 1  # --ttft-prompt 0: decode only (it once failed the whole call)
    (r,) = tpot
    assert r["tokens_per_step"] == pytest.approx(1 + 0.837 + 0.672)
    assert r["time_us"] == pytest.approx(r["step_time_us"] / r["tokens_per_step"])
    assert r["hit_rate"] is not None and r["compute_us"] is not None
    assert r["residency"] == "index"


def test_joined_calls_fill_the_paged_records_baseline_from_the_reference_ones() -> None:
    """Records of separate calls (paged in one, reference in another) joined by
    (name, batch, routing, prompt_len); a paged record without its reference keeps None."""
    from benchmarks.offload_timing import join_baseline

    def rec(forward: str, batch: int, time_us: float) -> dict:
        return dict(name="full_depth_tpot", batch=batch, routing="uniform", prompt_len=64,
                    forward=forward, time_us=time_us, baseline_time_us=None, speedup=None)  # fmt: skip

    spec = {**rec("paged", 1, 20.0), "mtp_k": 2}  # MTP records join only MTP baselines
    joined = join_baseline(
        [rec("paged", 1, 50.0), rec("paged", 16, 80.0), rec("reference", 1, 400.0), spec]
    )
    assert joined[0]["baseline_time_us"] == 400.0 and joined[0]["speedup"] == 8.0
    assert joined[1]["speedup"] is None and joined[2]["speedup"] is None
    assert joined[3]["speedup"] is None


def test_records_without_an_all_resident_run_split_the_step_by_its_measured_wait(
    tmp_path,
) -> None:
    """43 layers do not fit all-resident: compute_us and copy_wait_us come from the step's own
    measured wait (per token for MTP); the join tool writes a list with the run's facts."""
    from benchmarks.offload_timing import fill_compute, main

    base = dict(name="full_depth_tpot", batch=1, routing="uniform", prompt_len=64, mtp_k=0,
                forward="paged", time_us=50.0, compute_us=None, copy_wait_us=None,
                copy_wait_measured_us=30.0, baseline_time_us=None, speedup=None)  # fmt: skip
    split = fill_compute(base)
    assert (split["copy_wait_us"], split["compute_us"]) == (30.0, 20.0)
    assert split["compute_source"] == "step_minus_wait"
    assert fill_compute(split) == split  # joining written records keeps their source
    spec = fill_compute({**base, "time_us": 20.0, "tokens_per_step": 2.5, "mtp_k": 2})
    assert spec["copy_wait_us"] == 12.0 and spec["compute_us"] == 8.0
    resident = fill_compute({**base, "compute_us": 40.0, "copy_wait_us": 10.0})
    assert (resident["compute_us"], resident["compute_source"]) == (40.0, "all_resident")
    untimed = fill_compute({**base, "forward": "reference", "copy_wait_measured_us": None})
    assert untimed["compute_us"] is None and untimed["compute_source"] is None
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"shape": "flash", "layers": 43, "device_memory_gib": 68.5,
                               "records": [base]}))  # fmt: skip
    assert main([str(run), "--out", str(tmp_path / "joined.json")]) == 0
    (joined,) = json.loads((tmp_path / "joined.json").read_text())
    assert joined["device_memory_gib"] == 68.5 and joined["compute_us"] == 20.0


def test_paged_offload_halves_the_captured_batch_until_the_pools_slots_fit(caplog) -> None:
    """4 sequences x top-2 would need all 8 experts' slots: the captured decode batch halves to
    2 (4 slots), and the plan at that batch is the one served."""
    from dsv4.worker.build import planned_model_config
    from dsv4.worker.offload import startup_offload

    values = {**BUDGET, **OFFLOAD, "features.forward": "paged", "scheduler.max_num_seqs": 4,
              "model.device_memory_gib": PAGED_DEVICE_GIB}  # fmt: skip
    config = load_config(values)
    caplog.set_level("INFO", logger="dsv4.worker.fit")
    served, plan, offload = startup_offload(config, planned_model_config(config), torch.float32)
    assert served.features.cuda_graph_max_batch == 2 and plan.cache_slots == 4
    assert offload.num_offloaded == plan.offloaded_per_layer < 8
    # the start-up log says what the captured batch costs in resident experts
    assert any("experts a layer resident with decode graphs up to batch 2 (4 slots)" in m
               and "with --max-num-seqs 1" in m for m in caplog.messages)  # fmt: skip
    with pytest.raises(PlanDoesNotFit):
        startup_plan(config, planned_model_config(config), int(PAGED_DEVICE_GIB * GIB))


def test_kv_budget_leaves_the_step_workspaces_and_stays_inside_a_device_budget() -> None:
    """The H100 run it comes from: 12.8 GiB free after a 43-layer offload worker's weights;
    the KV cache once took 90% of that and the first 8K-token step found no room for its
    1 GiB dequantise scratch. The plan's buffers are held back now, and a
    `model.device_memory_gib` budget caps the cache as well."""
    from dsv4.worker.kv_budget import FREE_HEADROOM_BYTES, kv_budget_bytes

    gib = 1 << 30
    free, reserve = int(12.8 * gib), int(1.5 * gib)
    card, held = 80 * gib, 66 * gib
    assert kv_budget_bytes(free, 0.9, 0, card, held) == int(card * 0.9) - held
    assert kv_budget_bytes(free, 0.9, reserve, card, held) == int(card * 0.9) - held - reserve
    capped = kv_budget_bytes(free, 0.9, reserve, within_bytes=68 * gib, held_bytes=58 * gib)
    assert capped == int(68 * gib * 0.9) - 58 * gib - reserve < int(card * 0.9) - held - reserve
    # another process holds most of the card: no more than what is free, less a headroom
    crowded = kv_budget_bytes(2 * gib, 0.9, reserve, card, 20 * gib)
    assert crowded == 2 * gib - reserve - FREE_HEADROOM_BYTES
    # never negative: one request then refuses
    assert kv_budget_bytes(free, 0.9, 20 * gib, card, held) == 0


def test_kv_budget_is_a_share_of_the_card_not_of_what_the_weights_left() -> None:
    """The H200 run it comes from (43-layer V4-Flash, offload, `cache.memory_fraction` 0.94):
    the plan kept 222 of 256 experts a layer resident within 94% of the card, then the cache
    took 94% of the ~9.6 GiB left free: 8.2 GiB of KV for one 1280-token request, 98% of the
    card in use. As a share of the card (what the plan and `dsv4 up --memory-fraction F/N`
    count), the worker ends at 94%; workers sharing a card get the same cache whatever order
    they start in."""
    from dsv4.worker.kv_budget import kv_budget_bytes

    gib = 1 << 30
    card, held, reserve = int(140.4 * gib), int(130.3 * gib), int(0.34 * gib)
    free = card - held - int(0.5 * gib)  # the CUDA context is outside torch's reserved bytes
    budget = kv_budget_bytes(free, 0.94, reserve, within_bytes=card, held_bytes=held)
    assert budget == int(card * 0.94) - held - reserve
    assert held + budget + reserve <= 0.94 * card < held + int(free * 0.94)
    # two workers sharing the card at 0.45 each: the second's cache does not shrink by the first's
    weights = 12 * gib
    first = kv_budget_bytes(card - weights, 0.45, reserve, within_bytes=card, held_bytes=weights)
    left = card - 2 * weights - first - reserve
    second = kv_budget_bytes(left, 0.45, reserve, within_bytes=card, held_bytes=weights)
    assert first == second == int(card * 0.45) - weights - reserve
