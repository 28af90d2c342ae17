"""Routed experts served in the checkpoint's own format (`features.expert_weights=checkpoint`):
an MXFP4 tiny checkpoint loaded as stored against the same checkpoint dequantised at load.

Exactness: both sides compute on the same values. Dequantising MXFP4 (and FP8) is exact, so the
experts dequantised in the grouped GEMM (or, on the reference ops, per expert per call) equal
the weights a dequantising load holds, and the GEMMs then run on identical operands in the same
order: fp32 logits are bit-for-bit equal, not just close. The Triton kernel splits MXFP4's K
loop into even- and odd-column dots (a different fp32 summation order than one bf16 dot), so
its equality is the observed one on these shapes and held to a tolerance as well.
"""

from __future__ import annotations

import json

import pytest
import torch

from dsv4.config.model import tiny_config
from dsv4.errors import CheckpointError, ConfigError
from dsv4.model.offload import offload_model
from dsv4.model.tiny import random_model, write_checkpoint
from dsv4.model.weights import load_model
from dsv4.ops.quant import dequantize, fp8_block_quantize, mxfp4_quantize
from dsv4.plan import WeightFormats, expert_bytes
from dsv4.runner.paged import PagedSwitches
from tests.engine.conftest import greedy_request, make_core
from tests.engine.test_paged_forward import _lockstep_logits, run
from tests.leak import assert_no_leaks

FP4 = tiny_config().with_overrides(linear_dtype="fp8", expert_dtype="fp4")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp4_experts")
    write_checkpoint(path, FP4, seed=2, max_shard_bytes=1 << 20, with_tokenizer=False)
    return path


@pytest.fixture(scope="module")
def models(checkpoint):
    """(dequantised at load, experts as stored): fp32 models of the same checkpoint."""
    return load_model(checkpoint)[0], load_model(checkpoint, expert_weights="checkpoint")[0]


def test_paged_forward_on_mxfp4_experts_equals_the_dequantised_load(models) -> None:
    dense, native = models
    assert run(make_core(native, budget=64, paged={}), native) == run(
        make_core(dense, budget=64, paged={}), dense
    )
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(2, FP4.vocab_size, (150,), generator=gen).tolist()
    cores = [make_core(m, budget=64, paged={}) for m in (dense, native)]
    for core in cores:
        core.add_request(greedy_request("a", prompt, 4))
        core.add_request(greedy_request("b", prompt[:37], 4))
    steps = _lockstep_logits(*cores)
    assert len(steps) >= 4 and all(torch.equal(d, n) for d, n in steps)
    for core in cores:
        assert_no_leaks(core)


def test_reference_forward_dequantises_each_expert_per_call(models) -> None:
    dense, native = models
    with torch.no_grad():
        ids = torch.arange(2, 42)[None]
        assert torch.equal(native(ids).logits, dense(ids).logits)


def test_stacked_experts_hold_the_checkpoint_bytes_and_the_plan_counts_them(models) -> None:
    from dsv4.config import load_config
    from dsv4.worker.fit import GIB, startup_plan

    dense, native = models
    assert not any(".experts." in name for name, _ in native.named_parameters())
    e, d, inter = FP4.n_routed_experts, FP4.hidden_size, FP4.moe_intermediate_size
    per_layer = e * expert_bytes(FP4, WeightFormats("bf16", "checkpoint"))
    assert per_layer == e * 3 * (inter * d // 2 + inter * d // 32)  # half a byte + 1/32 scale
    blocks = [*native.layers, *native.mtp]
    for block in blocks:
        experts = block.ffn.stacked_experts
        assert experts.format == "mxfp4" and experts.nbytes == per_layer
        assert experts.w13.shape == (e, 2 * inter, d // 2) and experts.w13.dtype == torch.int8
        assert experts.w2_scale.shape == (e, d, inter // 32)
    dense_bytes = sum(p.nbytes for n, p in dense.named_parameters() if ".experts." in n)
    assert dense_bytes == len(blocks) * e * 3 * inter * d * 4  # fp32 here; bf16 is half that
    config = load_config({"model.max_model_len": 4096, "features.expert_weights": "checkpoint"})
    plan = startup_plan(config, FP4, 8 * GIB)  # no MTP without speculation: main layers only
    assert plan.routed_expert_bytes == FP4.num_hidden_layers * per_layer
    bf16 = startup_plan(load_config({"model.max_model_len": 4096}), FP4, 8 * GIB)
    assert bf16.routed_expert_bytes == FP4.num_hidden_layers * e * 3 * inter * d * 2


def test_grouped_kernel_reads_the_loaded_layout(models) -> None:
    """The Triton grouped GEMM (interpreter on CPU) on one layer's stacked MXFP4 experts, as
    loaded, against the same kernel on the dequantised experts."""
    from kernels.moe import moe_experts

    dense, native = models
    experts = native.layers[1].ffn.stacked_experts
    modules = dense.layers[1].ffn.experts
    w13 = torch.stack([torch.cat((m.w1.weight, m.w3.weight)) for m in modules]).bfloat16()
    w2 = torch.stack([m.w2.weight for m in modules]).bfloat16()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, FP4.hidden_size, generator=gen).bfloat16()
    ids = torch.rand(6, FP4.n_routed_experts, generator=gen).argsort(1)[:, :2]
    w = torch.rand(6, 2, generator=gen)
    y = moe_experts(x, ids, w, experts.w13, experts.w2, "mxfp4", experts.w13_scale,
                    experts.w2_scale, limit=FP4.swiglu_limit)  # fmt: skip
    want = moe_experts(x, ids, w, w13, w2, limit=FP4.swiglu_limit)
    torch.testing.assert_close(y, want, atol=1e-3 * want.abs().max().item(), rtol=0)


def test_fused_shared_expert_is_refused_with_quantised_experts(models) -> None:
    switches = PagedSwitches(fuse_shared_expert=True)
    with pytest.raises(ConfigError, match="one format") as info:
        make_core(models[1], paged={"switches": switches})
    assert info.value.field_name == "features.fuse_shared_expert"


def test_random_model_draws_experts_in_the_checkpoint_format() -> None:
    """The same draws as the bf16 random model, each expert quantised as a checkpoint stores it
    (`--model random:DIR` serving MXFP4); FP8 experts need whole 128-row scale blocks."""
    cfg = FP4.with_overrides(num_hidden_layers=1, compress_ratios=(0,), num_nextn_predict_layers=0)
    fp8 = {"expert_dtype": "fp8", "moe_intermediate_size": 128}
    for fmt, quantize, changes in (("mxfp4", mxfp4_quantize, {}), ("fp8", fp8_block_quantize, fp8)):
        dense = random_model(cfg.with_overrides(**changes), seed=5)
        native = random_model(cfg.with_overrides(**changes), seed=5, expert_weights="checkpoint")
        assert native.embed.weight.equal(dense.embed.weight)
        experts = native.layers[0].ffn.stacked_experts
        assert experts.format == fmt
        for e in (0, 7):
            module = dense.layers[0].ffn.experts[e]
            for got, want in zip(experts.dequantized(e, torch.float32),
                                 (module.w1.weight, module.w2.weight, module.w3.weight)):  # fmt: skip
                assert torch.equal(got, dequantize(*quantize(want), fmt, torch.float32))
    with pytest.raises(ConfigError, match="multiple of 128"):
        random_model(cfg.with_overrides(expert_dtype="fp8"), expert_weights="checkpoint")


def test_loader_rejects_experts_not_stored_in_the_configured_format(tmp_path) -> None:
    cfg = FP4.with_overrides(num_hidden_layers=1, compress_ratios=(0,), num_nextn_predict_layers=0)
    write_checkpoint(tmp_path, cfg.with_overrides(expert_dtype="bf16"), with_tokenizer=False)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "expert_dtype": "fp4"}))
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.weight.*dtype BF16"):
        load_model(tmp_path, expert_weights="checkpoint")


def test_offload_packs_the_stored_mxfp4_experts(models, checkpoint) -> None:
    """Expert offload of experts held as stored packs their bytes as MXFP4 blobs (no round trip
    through bf16): the reference forward still equals the dequantised load's."""
    native, _ = load_model(checkpoint, expert_weights="checkpoint")  # offload consumes it
    offload_model(native, num_offloaded=5, cache_slots=2, fmt="mxfp4")
    assert native.layers[0].ffn.stacked_experts is None
    with torch.no_grad():
        ids = torch.arange(2, 30)[None]
        assert torch.equal(native(ids).logits, models[0](ids).logits)
    with pytest.raises(ConfigError, match="as MXFP4 blobs"):
        offload_model(models[1], num_offloaded=1, cache_slots=1, fmt="dense")


def test_decode_benchmark_serves_mxfp4_experts(tmp_path) -> None:
    """`benchmarks/bench_decode_graphs.py --expert-weights checkpoint` (the GPU A/B against bf16
    experts) runs end to end on the CPU, and its read floor counts the MXFP4 bytes."""
    from benchmarks import bench_decode_graphs as decode_graphs
    from benchmarks import engine_setup as es

    out = tmp_path / "decode.json"
    argv = ["--dry-run", "--out", str(out), "--only", "plain", "--variants", "",
            "--expert-weights", "checkpoint"]  # fmt: skip
    assert decode_graphs.main(argv) == 0
    records = json.loads(out.read_text())
    assert records and all("experts=mxfp4" in r["shape"] for r in records)
    cfg = es.model_config("0,4,128,4", 8, True, expert_weights="checkpoint")
    model, _ = es.build_model(cfg, True, expert_weights="checkpoint")
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size
    assert es.param_bytes(model)[1] == 3 * d * inter // 2 + 3 * d * inter // 32  # e2m1 + UE8M0
