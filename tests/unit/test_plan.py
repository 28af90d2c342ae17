"""The memory planner against hand-computed V4-Flash and V4-Pro figures (docs/model.md
#configurations, #paged-cache), its verdicts, the start-up refusal and the `dsv4 plan` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from dsv4.errors import Dsv4Error
from dsv4.plan import (
    DOES_NOT_FIT,
    FITS,
    FITS_WITH_OFFLOAD,
    FITS_WITH_OFFLOAD_OVER_SLO,
    PlanDoesNotFit,
    PlanRequest,
    WeightFormats,
    check_fits,
    expert_bytes,
    full_flash_config,
    full_pro_config,
    plan_memory,
)

GIB = 1024**3
FLASH, PRO = full_flash_config(), full_pro_config()


def per_gpu(plan, kind, dtype=None):
    return sum(w.per_gpu_bytes for w in plan.weights if w.kind == kind and dtype in (None, w.dtype))


def total(plan, kind, dtype=None):
    return sum(w.total_bytes for w in plan.weights if w.kind == kind and dtype in (None, w.dtype))


def test_configs_have_the_real_layer_mix():
    assert FLASH.compress_ratios.count(0) == 2 and FLASH.compress_ratios.count(4) == 21
    assert FLASH.compress_ratios.count(128) == 20 and FLASH.compress_ratios[-1] == 4
    assert PRO.compress_ratios.count(4) == 30 and PRO.compress_ratios.count(128) == 31


def test_flash_weights_by_hand():
    # One MXFP4 expert: 3 matrices of 2048 x 4096 values at half a byte, + one UE8M0 byte per 32.
    one_expert = 3 * 2048 * 4096 // 2 + 3 * 2048 * 4096 // 32
    assert one_expert == 13_369_344 == expert_bytes(FLASH)  # 12.75 MiB
    assert one_expert / 2**20 == 12.75
    plan = plan_memory(PlanRequest(FLASH, num_gpus=1, gpu_mem_gib=141))
    assert total(plan, "routed_experts") == 43 * 256 * one_expert  # 137.06 GiB
    assert total(plan, "embed") == total(plan, "head") == 129280 * 4096 * 2
    # Attention FP8 per layer: wq_a 1024x4096, wq_b 32768x1024, wkv 512x4096, wo_a 8192x4096,
    # wo_b 4096x8192; scales one byte per 128x128 block.
    fp8 = 1024 * 4096 + 32768 * 1024 + 512 * 4096 + 8192 * 4096 + 4096 * 8192
    scales = 8 * 32 + 256 * 8 + 4 * 32 + 64 * 32 + 32 * 64
    assert total(plan, "attention", "fp8") == 43 * fp8 == 43 * 106_954_752
    assert total(plan, "attention", "e8m0") == 43 * scales
    assert total(plan, "shared_experts", "fp8") == 43 * 3 * 2048 * 4096
    assert total(plan, "indexer", "fp8") == 21 * 8192 * 1024  # C4 layers only
    # Compressors (bf16 wkv + wgate): C4 main 1024 wide (overlap 2) + indexer 256; C128 512.
    comp = 21 * 2 * (1024 + 256) * 4096 * 2 + 20 * 2 * 512 * 4096 * 2
    assert total(plan, "compressor", "bf16") == comp
    assert total(plan, "router", "int64") == 3 * 129280 * 6 * 8  # tid2eid of the hash layers
    assert total(plan, "router", "fp32") == 40 * 256 * 4  # biases of the scored layers
    hc = 43 * 2 * (24 * 4 * 4096 + 24 + 3) * 4 + (4 * 4 * 4096 + 4 + 1) * 4
    assert total(plan, "hc") == hc
    everything = (
        43 * 256 * one_expert + 2 * 129280 * 4096 * 2 + 43 * (fp8 + scales)
        + 43 * (3 * 2048 * 4096 + 3 * 16 * 32) + 21 * (8192 * 1024 + 64 * 8) + comp
        + 43 * 256 * 4096 * 2 + 3 * 129280 * 6 * 8 + 40 * 256 * 4 + hc
        + 21 * 64 * 4096 * 2  # indexer weights_proj bf16
        + (21 * (4 * 1024 + 4 * 256) + 20 * 128 * 512) * 4  # ape fp32
        + 43 * 64 * 4  # attn_sink fp32
        + (43 * (4096 * 2 + 1024 + 512) + 21 * (512 + 128) + 20 * 512 + 4096) * 2  # norms
    )  # fmt: skip
    assert plan.weight_bytes == everything
    # ~3.3 GiB per layer, ~2 x 1 GiB embed/head; "about 150 GB" in all.
    per_layer = (everything - 2 * 129280 * 4096 * 2) / 43 / GIB
    assert 3.2 < per_layer < 3.4 and 145 < everything / GIB < 146


def test_pro_weights_by_hand():
    one_expert = 3 * 3072 * 7168 // 2 + 3 * 3072 * 7168 // 32
    assert one_expert == 35_094_528 == expert_bytes(PRO)  # 33.47 MiB
    plan = plan_memory(PlanRequest(PRO, num_gpus=8, gpu_mem_gib=141))
    assert total(plan, "routed_experts") == 61 * 384 * one_expert  # 765.6 GiB
    assert per_gpu(plan, "routed_experts") == 61 * (384 // 8) * one_expert  # EP 8: 48 each
    assert per_gpu(plan, "embed") == 129280 * 7168 * 2 // 8  # vocab-parallel
    fp8 = 1536 * 7168 + 65536 * 1536 + 512 * 7168 + 16384 * 4096 + 7168 * 16384
    assert total(plan, "attention", "fp8") == 61 * fp8
    per_layer = (plan_total := sum(w.total_bytes for w in plan.weights)) - 2 * 129280 * 7168 * 2
    assert 12.7 < per_layer / 61 / GIB < 13.1  # ~12.9 GiB per layer
    assert 790 < plan_total / GIB < 800  # ~1.6 T parameters, mostly 4-bit


def test_flash_kv_by_hand():
    plan = plan_memory(PlanRequest(FLASH, gpu_mem_gib=141, max_model_len=65536, max_num_seqs=4))
    kinds = {k.kind: k for k in plan.kv.kinds}
    # fp8_ds_mla entry 584 B (448 e4m3 + 64 bf16 rope + 8 scale bytes); MXFP4 indexer key 68 B.
    assert kinds["c4"].paged_bytes_per_token == 584 / 4 + 68 / 4 == 163
    assert kinds["c128"].paged_bytes_per_token == 584 / 128
    assert kinds["swa"].paged_bytes_per_token == 0
    window = 128 * 584
    assert kinds["swa"].ring_bytes_per_request == window
    assert kinds["c4"].ring_bytes_per_request == window + 8 * 8192 + 8 * 2048  # fp32 states
    assert kinds["c128"].ring_bytes_per_request == window + 128 * 4096
    assert (kinds["c4"].num_layers, kinds["c128"].num_layers, kinds["swa"].num_layers) == (
        21, 20, 2,
    )  # fmt: skip
    slab = 21 * (64 * 584 + 64 * 68) + 20 * 2 * 584  # one 256-token block of every layer
    assert plan.kv.block_stride_bytes == -(-slab // 1168) * 1168 == 900_528
    ring_total = 43 * window + 21 * (8 * 8192 + 8 * 2048) + 20 * 128 * 4096
    assert plan.kv.num_ring_blocks >= -(-ring_total // 900_528)
    assert plan.kv.bytes_per_request == (plan.kv.num_ring_blocks + 256) * 900_528
    assert plan.kv.total_bytes == 4 * plan.kv.bytes_per_request


def test_flash_on_eight_h200_fits_and_shards():
    plan = plan_memory(PlanRequest(FLASH, num_gpus=8, gpu_mem_gib=141))
    assert plan.verdict == FITS and plan.offloaded_per_layer == 0
    assert per_gpu(plan, "routed_experts") == 43 * 32 * expert_bytes(FLASH)
    assert plan.needed_bytes <= plan.usable_bytes
    assert plan.message.startswith("fits:")


def test_flash_on_one_h200_needs_offload_with_minimal_k():
    req = PlanRequest(FLASH, gpu_mem_gib=141, host_mem_gib=128, max_num_seqs=16)
    plan = plan_memory(req)
    assert plan.verdict == FITS_WITH_OFFLOAD
    k, slots, eb = plan.offloaded_per_layer, plan.cache_slots, plan.expert_bytes
    assert slots == FLASH.num_experts_per_tok
    assert plan.device_expert_bytes == 43 * (256 - k + slots) * eb
    idle = 256 * eb if plan.idle_moe_layers else 0  # the unused MTP layer: all its experts cold
    assert plan.host_bytes == 43 * k * eb + idle <= 0.8 * 128 * GIB
    assert plan.needed_bytes <= plan.usable_bytes
    assert plan.needed_bytes + 43 * eb > plan.usable_bytes  # K - 1 would not fit: K is minimal
    assert f"{k} of 256 experts per layer offloaded" in plan.message
    check_fits(plan)


def test_the_prefill_staging_buffer_counts_only_with_offload():
    """32 staging experts (`features.expert_staging`): with offload they are device expert
    bytes, paid for by offloading more (K stays minimal); a plan that fits whole has none."""
    base = PlanRequest(FLASH, gpu_mem_gib=141, host_mem_gib=128, max_num_seqs=16)
    plain, staged = (plan_memory(replace(base, staging_experts=n)) for n in (0, 32))
    eb, k = staged.expert_bytes, staged.offloaded_per_layer
    assert staged.verdict == FITS_WITH_OFFLOAD and k >= plain.offloaded_per_layer
    # the plain plan's slack either holds the 32 staging experts or K grows to make room
    slack = plain.usable_bytes - plain.needed_bytes
    assert (k > plain.offloaded_per_layer) == (slack < 32 * eb)
    assert staged.device_expert_bytes == (43 * (256 - k + staged.cache_slots) + 32) * eb
    assert staged.needed_bytes <= staged.usable_bytes < staged.needed_bytes + 43 * eb
    whole = plan_memory(PlanRequest(FLASH, num_gpus=8, gpu_mem_gib=141, staging_experts=32))
    assert whole.offloaded_per_layer == 0 and whole.staging_experts == 0


def test_plan_that_does_not_fit_refuses_to_start_naming_the_shortfall():
    plan = plan_memory(PlanRequest(FLASH, gpu_mem_gib=141, host_mem_gib=0, max_num_seqs=16))
    assert plan.verdict == DOES_NOT_FIT
    full = plan_memory(PlanRequest(FLASH, gpu_mem_gib=141, host_mem_gib=0, max_num_seqs=16))
    with pytest.raises(PlanDoesNotFit) as err:
        check_fits(full)
    assert isinstance(err.value, Dsv4Error)
    message = err.value.message
    resident = 43 * 256 * expert_bytes(FLASH) + plan.weight_bytes - plan.routed_expert_bytes
    # the MTP layer is loaded though it never runs: its weights, with all 256 experts
    mtp = plan.idle_bytes + 256 * expert_bytes(FLASH)
    assert f"unused MTP layer {mtp / GIB:.2f} GiB" in message
    short = resident + mtp + plan.kv.total_bytes + plan.buffer_bytes - plan.usable_bytes
    assert f"short by {short / GIB:.2f} GiB per GPU" in message
    assert "--host-mem >= " in message and "pinned host memory" in message


def test_pro_on_one_80gb_gpu_does_not_fit_even_fully_offloaded():
    plan = plan_memory(PlanRequest(PRO, gpu_mem_gib=80, host_mem_gib=4096, max_num_seqs=256))
    assert plan.verdict == DOES_NOT_FIT
    assert "Even with all 384 experts per layer offloaded" in plan.message
    assert "Fixes:" in plan.message


def test_mtp_runs_only_when_speculative_decoding_is_on():
    off = plan_memory(PlanRequest(FLASH, num_gpus=8, gpu_mem_gib=141))
    on = plan_memory(PlanRequest(FLASH, num_gpus=8, gpu_mem_gib=141, num_speculative_tokens=2))
    assert not any(w.is_mtp for w in off.weights) and on.num_moe_layers == 44
    # off, the MTP layer is still loaded (its 32 experts of 8 GPUs too): idle, counted apart
    assert (off.idle_moe_layers, on.idle_moe_layers, on.idle_device_bytes) == (1, 0, 0)
    mtp_weights = sum(w.per_gpu_bytes for w in on.weights if w.is_mtp)
    assert off.idle_device_bytes == mtp_weights == off.idle_bytes + 32 * expert_bytes(FLASH)
    mtp_experts = sum(w.total_bytes for w in on.weights if w.is_mtp and w.kind == "routed_experts")
    assert mtp_experts == 256 * expert_bytes(FLASH)
    assert "mtp_draft" in {b.name for b in on.buffers} - {b.name for b in off.buffers}
    swa_on, swa_off = (next(k for k in p.kv.kinds if k.kind == "swa") for p in (on, off))
    assert (swa_on.num_layers, swa_off.num_layers) == (3, 2)  # the MTP layer's window
    assert swa_on.ring_bytes_per_request == (128 + 2) * 584  # + k draft slots per ring


def test_cli_json_and_exit_status(capsys):
    from dsv4.commands.cli import main

    stored = ["--expert-format", "checkpoint", "--linear-format", "checkpoint"]
    assert main(["plan", "--shape", "flash", "--gpus", "8", "--gpu-mem", "141", *stored,
                 "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == FITS and out["expert_bytes"] == 13_369_344
    assert main(["plan", "--shape", "pro", "--gpus", "1", "--gpu-mem", "80", *stored]) == 1
    text = capsys.readouterr().out
    assert "routed_experts [fp4]" in text and "verdict: does_not_fit" in text
    # the worker's defaults: bf16 experts and linears, KV for one request of the model's length
    assert main(["plan", "--shape", "flash", "--gpus", "8", "--gpu-mem", "141", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["expert_bytes"] == 3 * 4096 * 2048 * 2 and out["max_num_seqs"] == 1
    assert (out["worker"]["expert_format"], out["max_model_len"]) == ("bf16", 1 << 20)


def test_host_memory_is_per_node_shared_by_its_gpus():
    """V4-Pro on 8 H200s offloads 41 of 48 experts per layer: 81.74 GiB of pinned host memory
    per GPU, 8 x that on one node; 512 GiB (409.6 pinnable) does not hold it."""
    req = PlanRequest(PRO, num_gpus=8, gpu_mem_gib=141, host_mem_gib=512)
    plan = plan_memory(req)
    assert plan.verdict == DOES_NOT_FIT and plan.request.gpus_per_node == 8
    assert plan.node_host_bytes == 8 * plan.host_bytes > plan.host_usable_bytes
    assert plan.host_bytes <= plan.host_usable_bytes  # the per-GPU check used to pass
    need = -(-plan.node_host_bytes // int(0.8 * GIB))
    assert f"give --host-mem >= {need} per node" in plan.message
    # One GPU per node (eight hosts): each node holds one GPU's experts.
    spread = plan_memory(PlanRequest(PRO, num_gpus=8, gpu_mem_gib=141, host_mem_gib=512,
                                     gpus_per_node=1, tpot_slo_ms=1000))  # fmt: skip
    assert spread.verdict == FITS_WITH_OFFLOAD and spread.node_host_bytes == spread.host_bytes


def test_offload_over_the_tpot_slo_is_not_plain_fits():
    """The fetch estimate: top_k * K / E missed experts per layer and token, over H2D."""
    req = PlanRequest(PRO, num_gpus=8, gpu_mem_gib=141, host_mem_gib=1024)
    plan = plan_memory(req)
    k, e, eb = plan.offloaded_per_layer, plan.experts_per_layer, plan.expert_bytes
    ms = 61 * PRO.num_experts_per_tok * k / e * eb / 25e9 * 1e3
    assert plan.fetch_ms_per_token == pytest.approx(ms) and ms > 50
    assert plan.verdict == FITS_WITH_OFFLOAD_OVER_SLO and plan.fits
    assert plan.message.startswith("OVER THE TPOT SLO") and "--tpot-slo-ms 50" in plan.message
    relaxed = plan_memory(PlanRequest(PRO, num_gpus=8, gpu_mem_gib=141, host_mem_gib=1024,
                                      tpot_slo_ms=ms + 1))  # fmt: skip
    assert relaxed.verdict == FITS_WITH_OFFLOAD and relaxed.message.startswith("fits with")
    # the same offload on a host whose copies run at 55 GB/s (PCIe Gen5 x16)
    fast = plan_memory(PlanRequest(PRO, num_gpus=8, gpu_mem_gib=141, host_mem_gib=1024,
                                   h2d_gb_per_s=55.0))  # fmt: skip
    assert fast.fetch_ms_per_token == pytest.approx(ms * 25 / 55)


def test_cli_h2d_bandwidth_sets_the_fetch_estimate(capsys):
    from dsv4.commands.cli import main

    args = ["plan", "--shape", "flash", "--gpu-mem", "141", "--host-mem", "128",
            "--expert-weights", "checkpoint", "--linear-weights", "checkpoint", "--json"]  # fmt: skip
    main(args)
    slow = json.loads(capsys.readouterr().out)
    main([*args, "--h2d-gbps", "50"])
    fast = json.loads(capsys.readouterr().out)
    assert fast["offloaded_per_layer"] == slow["offloaded_per_layer"] > 0
    assert fast["fetch_ms_per_token"] == pytest.approx(slow["fetch_ms_per_token"] / 2)


def test_bad_node_and_slo_values_are_config_errors():
    from dsv4.errors import ConfigError

    with pytest.raises(ConfigError, match="gpus_per_node"):
        plan_memory(PlanRequest(FLASH, num_gpus=8, gpus_per_node=3, gpu_mem_gib=80))
    with pytest.raises(ConfigError, match="tpot_slo_ms"):
        plan_memory(PlanRequest(FLASH, gpu_mem_gib=80, tpot_slo_ms=0))
    with pytest.raises(ConfigError, match="host_mem_gib"):
        plan_memory(PlanRequest(FLASH, gpu_mem_gib=80, host_mem_gib=-1))


def test_bad_parallel_sizes_are_config_errors():
    from dsv4.errors import ConfigError

    with pytest.raises(ConfigError, match="tp"):
        plan_memory(PlanRequest(FLASH, num_gpus=8, tp=3, gpu_mem_gib=80))


def test_planner_imports_without_torch():
    code = "import sys, dsv4.plan, dsv4.commands.plan; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_reads_a_checkpoint_config(tmp_path, capsys):
    from dsv4.commands.cli import main
    from dsv4.config.model import tiny_config

    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_hf_dict()))
    argv = ["plan", "--model", str(tmp_path), "--gpu-mem", "4", "--max-num-seqs", "4", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == FITS and out["experts_per_layer"] == 8 and out["num_moe_layers"] == 4
    assert out["max_num_seqs"] == 4  # given: KV for 4 full-length requests (the worker's: one)
    assert out["worker"]["cuda_graph_max_batch"] == 128  # the captured batch: min(4, this)


def test_weights_held_as_stored_reserve_their_dequantise_workspace():
    """Prefill-sized steps dequantise MXFP4 experts into a bf16 scratch (21 V4-Flash experts of
    3 x 4096 x 2048 bf16 fit in 1 GiB; on 8 GPUs the 32 local experts cross 48 pairs an expert
    at 256 tokens, so the decode graphs' pool holds one too), and FP8 linears above 2 rows one
    linear at a time as bf16 (the largest: 32768 x 1024, wq_b)."""
    plan = plan_memory(PlanRequest(FLASH, num_gpus=8, gpu_mem_gib=141))
    sizes = {b.name: b.nbytes for b in plan.buffers}
    assert sizes["moe_dequant_scratch"] == 21 * 3 * 4096 * 2048 * 2
    assert sizes["fp8_linear_dequant"] == 32768 * 1024 * 2
    assert sizes["cuda_graphs_moe_dequant_scratch"] == sizes["moe_dequant_scratch"]
    dense = plan_memory(PlanRequest(FLASH, num_gpus=8, gpu_mem_gib=141,
                                    formats=WeightFormats(linears="bf16", experts="bf16")))  # fmt: skip
    dequant = sum(v for name, v in sizes.items() if "dequant" in name)
    assert not any("dequant" in b.name for b in dense.buffers)
    assert sum(b.nbytes for b in plan.buffers) - sum(b.nbytes for b in dense.buffers) == dequant
    tiny = plan_memory(PlanRequest(FLASH, num_gpus=8, gpu_mem_gib=141, max_num_batched_tokens=2,
                                   max_num_seqs=2, cuda_graphs=False))  # fmt: skip
    assert not any("dequant" in b.name for b in tiny.buffers)


def test_kernel_thresholds_are_the_planners():
    """The planner counts the kernels' transient copies with the thresholds the kernels use:
    both read them from the torch-free dsv4.ops.limits."""
    import importlib

    from dsv4.ops import limits
    from dsv4.plan import budget

    moe_dequant = importlib.import_module("kernels.moe_dequant")
    fp8_linear = importlib.import_module("kernels.fp8_linear")
    assert (
        moe_dequant.SCRATCH_BYTES
        == budget.MOE_DEQUANT_SCRATCH_BYTES
        == limits.MOE_DEQUANT_SCRATCH_BYTES
    )
    assert moe_dequant.DEQUANT_MIN_PAIRS_PER_EXPERT == budget.MOE_DEQUANT_MIN_PAIRS_PER_EXPERT
    assert fp8_linear.GEMV_MAX_ROWS == budget.FP8_GEMV_MAX_ROWS == limits.FP8_GEMV_MAX_ROWS


def _worker_decision(values: dict, model, gpu_gib: float) -> tuple:
    """What a worker's start-up decides with `values` on a CUDA card of `gpu_gib` GiB (as
    `build_worker_runtime` resolves and plans): (verdict, K, cache slots), or a refusal."""
    from dsv4.config import load_config, resolve_auto
    from dsv4.worker.fit import GIB, device_plan

    config = resolve_auto(load_config(values, None, {}), has_cuda=True, hostname="h", pid=1,
                          model=model)  # fmt: skip
    kv = "bf16" if model.head_dim != 512 else "fp8"  # auto: fp8 for the 512-wide heads
    assert config.cache.kv_dtype == kv
    try:
        _, plan = device_plan(config, model, int(gpu_gib * GIB))
    except PlanDoesNotFit:
        return (DOES_NOT_FIT,)
    return plan.verdict, plan.offloaded_per_layer, plan.cache_slots


def _worker_env_only(monkeypatch) -> None:
    """No DSV4_* variable: the CLI layers them as the worker does, `_worker_decision` not."""
    for name in [n for n in os.environ if n.startswith("DSV4_")]:
        monkeypatch.delenv(name)


CHECKPOINT = {"features.linear_weights": "checkpoint", "features.expert_weights": "checkpoint"}
CHECKPOINT_FLAGS = ["--linear-format", "checkpoint", "--expert-format", "checkpoint"]
BF16 = {"features.linear_weights": "bf16", "features.expert_weights": "bf16"}
BF16_FLAGS = ["--linear-format", "bf16", "--expert-format", "bf16"]


@pytest.mark.parametrize(
    ("flags", "values", "expected"),
    [
        ([*BF16_FLAGS, "--host-mem", "128"], {**BF16, "model.host_memory_gib": 128},
         DOES_NOT_FIT),  # bf16 experts: ~458 GiB of pinned host memory
        (["--host-mem", "128"], {"model.host_memory_gib": 128},
         FITS_WITH_OFFLOAD_OVER_SLO),  # auto: bf16 does not fit, the checkpoint's formats do
        ([*CHECKPOINT_FLAGS, "--host-mem", "128"], {**CHECKPOINT, "model.host_memory_gib": 128},
         FITS_WITH_OFFLOAD_OVER_SLO),
        ([*CHECKPOINT_FLAGS, "--host-mem", "128", "--max-model-len", "65536", "--spec-tokens",
          "1"], {**CHECKPOINT, "model.host_memory_gib": 128, "model.max_model_len": 65536,
                 "speculative.method": "mtp"}, FITS_WITH_OFFLOAD_OVER_SLO),
        ([*CHECKPOINT_FLAGS, "--host-memory-gib", "48", "--expert-staging", "8"],
         {**CHECKPOINT, "model.host_memory_gib": 48, "features.expert_staging": 8}, DOES_NOT_FIT),
        (CHECKPOINT_FLAGS, CHECKPOINT, DOES_NOT_FIT),  # no host memory: no offload
        ([*CHECKPOINT_FLAGS, "--forward", "reference", "--host-mem", "128"],
         {**CHECKPOINT, "features.forward": "reference", "model.host_memory_gib": 128},
         FITS_WITH_OFFLOAD),
    ],
    ids=["bf16", "auto", "offload", "mtp-64k", "staging-short-host", "no-host", "reference"],
)  # fmt: skip
def test_cli_answers_the_workers_startup_question_for_flash(flags, values, expected, capsys,
                                                            monkeypatch):  # fmt: skip
    """`dsv4 plan` with a worker's settings on one 141 GiB card gives the verdict, K and cache
    slots that worker's start-up takes (its defaults, its decode batch's slots, its graph batch
    shrunk to fit the offload, its fp32 copies and staging buffer)."""
    from dsv4.commands.cli import main

    _worker_env_only(monkeypatch)
    code = main(["plan", "--shape", "flash", "--gpu-mem", "141", *flags, "--json"])
    out = json.loads(capsys.readouterr().out)
    worker = _worker_decision(values, FLASH, 141)
    assert out["verdict"] == expected and code == (0 if worker[0] != DOES_NOT_FIT else 1)
    if out["verdict"] == DOES_NOT_FIT:
        assert worker == (DOES_NOT_FIT,)
    else:
        assert worker == (out["verdict"], out["offloaded_per_layer"], out["cache_slots"])


def test_cli_shows_the_formats_auto_weights_resolve_to(capsys, monkeypatch):
    """Issue 22: V4-Flash with default (auto) weights on one 141 GiB card plans the checkpoint's
    MXFP4 experts and FP8 linears, and the worker block says so; on 8 such cards, bf16."""
    from dsv4.commands.cli import main

    _worker_env_only(monkeypatch)
    one = ["plan", "--shape", "flash", "--gpu-mem", "141", "--host-mem", "128", "--json"]
    assert main(one) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] in (FITS_WITH_OFFLOAD, FITS_WITH_OFFLOAD_OVER_SLO)
    assert (out["worker"]["expert_format"], out["worker"]["linear_format"]) == (
        "checkpoint", "checkpoint")  # fmt: skip
    assert main([*one, "--gpus", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == FITS
    assert (out["worker"]["expert_format"], out["worker"]["linear_format"]) == ("bf16", "bf16")


@pytest.mark.parametrize(
    ("gpu_gib", "flags", "values", "expected"),
    [
        (1.4, ["--host-mem", "1"], {"model.host_memory_gib": 1}, FITS_WITH_OFFLOAD),  # batch 2
        (1.45, ["--host-mem", "1"], {"model.host_memory_gib": 1}, FITS),
        (1.38, ["--host-mem", "1"], {"model.host_memory_gib": 1}, DOES_NOT_FIT),
        (1.4, ["--forward", "reference", "--dtype", "fp32"],
         {"features.forward": "reference", "model.dtype": "fp32"}, FITS),
        (1.4, ["--host-mem", "1", "--no-cuda-graphs"],
         {"model.host_memory_gib": 1, "features.cuda_graphs": False}, FITS),  # no graph pool
    ],
    ids=["offload", "fits", "no-fit", "reference-fp32", "eager"],
)  # fmt: skip
def test_cli_answers_the_workers_startup_question_for_a_config_only_dir(
    gpu_gib, flags, values, expected, tmp_path, capsys, monkeypatch
):
    from dsv4.commands.cli import main
    from dsv4.config.model import tiny_config
    from dsv4.model.tiny import write_model_spec

    _worker_env_only(monkeypatch)
    spec = str(write_model_spec(tmp_path / "spec", tiny_config()))
    main(["plan", "--model", spec, "--gpu-mem", str(gpu_gib), *flags, "--json"])
    out = json.loads(capsys.readouterr().out)
    worker = _worker_decision({**values, "model.path": spec}, tiny_config(), gpu_gib)
    assert out["verdict"] == expected
    if expected == DOES_NOT_FIT:
        assert worker == (DOES_NOT_FIT,)
    else:
        assert worker == (out["verdict"], out["offloaded_per_layer"], out["cache_slots"])
    assert (out["max_num_seqs"], out["max_model_len"]) == (1, tiny_config().max_position_embeddings)
