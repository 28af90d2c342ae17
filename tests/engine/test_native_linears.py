"""FP8 linears served as the checkpoint stores them (`features.linear_weights=checkpoint`): a tiny
FP8 checkpoint loaded as stored against the same checkpoint dequantised at load.

Exactness: on the torch reference op both sides compute on the same values (UE8M0 dequantising
is exact, in fp32 and in bf16), so F.linear runs on identical operands: logits are bit-for-bit
equal, fp32 and bf16, reference and paged forward. The Triton kernel (interpreter here) sums K
in tiles (and splits), another fp32 order: fp32 logits agree to ~1e-6 relative; bf16 logits
differ where a reordered sum lands on the other side of a bf16 rounding of an intermediate
activation (observed: 0.016 at logits of magnitude 4, one bf16 ulp there).
"""

from __future__ import annotations

import json

import pytest
import torch

from dsv4.config.model import tiny_config
from dsv4.errors import CheckpointError, ConfigError
from dsv4.model.fp8 import FP8Linear
from dsv4.model.tiny import random_model, write_checkpoint
from dsv4.model.weights import load_model
from dsv4.ops.quant import fp8_block_dequantize, fp8_block_quantize
from dsv4.runner.kernel_bridge import hot_ops, kernel_choices
from dsv4.runner.paged import PagedSwitches
from kernels.backend import KernelBackendConfig
from tests.engine.conftest import greedy_request, make_core
from tests.engine.test_paged_forward import _lockstep_logits
from tests.leak import assert_no_leaks

FP8 = tiny_config().with_overrides(linear_dtype="fp8", expert_dtype="fp4")
SWAPPED = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
           "shared_experts.w1", "shared_experts.w2", "shared_experts.w3", "e_proj", "h_proj")  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8_linears")
    write_checkpoint(path, FP8, seed=2, max_shard_bytes=1 << 20, with_tokenizer=False)
    return path


@pytest.fixture(scope="module")
def models(checkpoint):
    """(dequantised at load, linears as stored): fp32 models of the same checkpoint."""
    return load_model(checkpoint)[0], load_model(checkpoint, linear_weights="checkpoint")[0]


def _fp8_modules(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}


def test_loaded_modules_hold_the_stored_bytes(models, checkpoint) -> None:
    dense, native = models
    found = _fp8_modules(native)
    assert found and all(n.endswith(SWAPPED) for n in found)
    assert any(n.endswith("attn.wo_a") for n in found)
    assert sum(n.endswith("attn.wq_a") for n in found) == FP8.num_hidden_layers + 1  # + MTP
    for name, module in found.items():
        assert module.weight.dtype == torch.float8_e4m3fn
        assert module.scale.dtype == torch.float8_e8m0fnu
        want = dense.get_parameter(f"{name}.weight")
        assert torch.equal(fp8_block_dequantize(module.weight, module.scale, 128, want.dtype), want)
    keys = set(native.state_dict())
    assert "layers.0.attn.wq_a.scale" in keys and "mtp.0.e_proj.scale" in keys


def test_reference_forward_equals_the_dequantised_load(models, checkpoint) -> None:
    dense, native = models
    ids = torch.arange(2, 42)[None]
    with torch.no_grad():
        want, got = dense(ids), native(ids)
        assert torch.equal(got.logits, want.logits)
        draft = native.mtp_forward(got.streams, ids).logits
        assert torch.equal(draft, dense.mtp_forward(want.streams, ids).logits)
    dense16 = load_model(checkpoint, dtype=torch.bfloat16)[0]
    native16 = load_model(checkpoint, dtype=torch.bfloat16, linear_weights="checkpoint")[0]
    with torch.no_grad():
        assert torch.equal(native16(ids).logits, dense16(ids).logits)


def test_paged_forward_on_fp8_linears_equals_the_dequantised_load(models) -> None:
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(2, FP8.vocab_size, (150,), generator=gen).tolist()
    cores = [make_core(m, budget=64, paged={}) for m in models]
    for core in cores:
        core.add_request(greedy_request("a", prompt, 4))
        core.add_request(greedy_request("b", prompt[:37], 4))
    steps = _lockstep_logits(*cores)
    assert len(steps) >= 4 and all(torch.equal(d, n) for d, n in steps)
    for core in cores:
        assert_no_leaks(core)


def test_triton_kernel_backend_in_the_model(models, checkpoint) -> None:
    """The model's FP8 linears (and wo_a's grouped one) on the Triton kernel, interpreted."""
    dense, native = models
    native16 = load_model(checkpoint, dtype=torch.bfloat16, linear_weights="checkpoint")[0]
    dense16 = load_model(checkpoint, dtype=torch.bfloat16)[0]
    ids = torch.arange(2, 14)[None]
    only_fp8 = KernelBackendConfig("ref", {"fp8_linear": "triton", "fp8_grouped_linear": "triton"})
    chosen = kernel_choices(only_fp8, "cpu")
    assert chosen["fp8_linear"] == chosen["fp8_grouped_linear"] == "triton"
    assert chosen["route"] == chosen["hc_pre"] == chosen["hc_post"] == "ref"
    with torch.no_grad():
        want, want16 = dense(ids).logits, dense16(ids).logits
        native16.use_hot_ops(hot_ops(only_fp8, "cpu"))  # loaded here: no other test sees it
        got16 = native16(ids).logits
        try:
            got = native.use_hot_ops(hot_ops(only_fp8, "cpu"))(ids).logits
        finally:
            native.use_hot_ops(hot_ops(KernelBackendConfig("ref"), "cpu"))  # module fixture
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got16, want16, atol=5e-2, rtol=2e-2)


def test_memory_plan_counts_the_fp8_bytes(models) -> None:
    from dsv4.config import load_config
    from dsv4.worker.fit import GIB, startup_plan

    _, native = models
    held = sum(m.weight.nbytes + m.scale.nbytes for n, m in _fp8_modules(native).items()
               if not n.startswith("mtp."))  # fmt: skip
    config = load_config({"model.max_model_len": 4096, "features.linear_weights": "checkpoint"})
    plan = startup_plan(config, FP8, 8 * GIB)  # no MTP without speculation: main layers only
    fp8 = sum(w.per_gpu_bytes for w in plan.weights if w.dtype in ("fp8", "e8m0"))
    assert fp8 == held
    bf16 = startup_plan(load_config({"model.max_model_len": 4096}), FP8, 8 * GIB)
    assert bf16.weight_bytes - plan.weight_bytes == 2 * sum(
        m.weight.numel() for n, m in _fp8_modules(native).items() if not n.startswith("mtp.")
    ) - held  # fmt: skip


def test_random_model_draws_linears_in_the_checkpoint_format() -> None:
    """The same draws as the bf16 random model, each FP8 linear quantised as a checkpoint
    stores it (`--model random:DIR` serving FP8 linears); a bf16 config keeps nn.Linear."""
    cfg = FP8.with_overrides(num_hidden_layers=1, compress_ratios=(4,), num_nextn_predict_layers=0)
    dense = random_model(cfg, seed=5)
    native = random_model(cfg, seed=5, linear_weights="checkpoint")
    assert native.embed.weight.equal(dense.embed.weight)
    for name, module in _fp8_modules(native).items():
        want = fp8_block_dequantize(*fp8_block_quantize(dense.get_parameter(f"{name}.weight")),
                                    128, torch.float32)  # fmt: skip
        assert torch.equal(fp8_block_dequantize(module.weight, module.scale, 128, torch.float32),
                           want)  # fmt: skip
    plain = cfg.with_overrides(linear_dtype="bf16")
    assert not _fp8_modules(random_model(plain, linear_weights="checkpoint"))
    with pytest.raises(ConfigError, match="scale blocks"):
        random_model(cfg.with_overrides(fp8_block_size=64), linear_weights="checkpoint")
    with pytest.raises(ConfigError, match="bf16 or checkpoint"):
        random_model(cfg, linear_weights="fp8")


def test_loader_rejects_linears_not_stored_in_the_configured_format(tmp_path) -> None:
    cfg = FP8.with_overrides(num_hidden_layers=1, compress_ratios=(0,), num_nextn_predict_layers=0)
    write_checkpoint(tmp_path, cfg.with_overrides(linear_dtype="bf16"), with_tokenizer=False)
    assert not _fp8_modules(load_model(tmp_path, linear_weights="checkpoint")[0])  # bf16: as is
    raw = json.loads((tmp_path / "config.json").read_text())
    quant = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps({**raw, "quantization_config": quant}))
    with pytest.raises(CheckpointError, match=r"attn\.w\w+\.weight.*dtype BF16.*linear_weights"):
        load_model(tmp_path, linear_weights="checkpoint")


def test_unsupported_combinations_are_refused(models) -> None:
    from dsv4.parallel.group import ParallelGroup
    from dsv4.parallel.shard import shard_model

    with pytest.raises(ConfigError, match="one grouped GEMM") as info:
        make_core(models[1], paged={"switches": PagedSwitches(fuse_shared_expert=True)})
    assert info.value.field_name == "features.fuse_shared_expert"
    with pytest.raises(ConfigError, match="tensor parallelism") as info:
        shard_model(models[1], ParallelGroup.single())
    assert info.value.field_name == "features.linear_weights"


def test_offload_keeps_the_fp8_linears(checkpoint, models) -> None:
    """Expert offload moves routed experts only: the FP8 linears stay as loaded."""
    from dsv4.model.offload import offload_model

    native = load_model(checkpoint, linear_weights="checkpoint")[0]  # offload consumes it
    offload_model(native, num_offloaded=5, cache_slots=2)
    assert _fp8_modules(native)
    with torch.no_grad():
        ids = torch.arange(2, 30)[None]
        assert torch.equal(native(ids).logits, models[0](ids).logits)


def test_decode_benchmark_serves_fp8_linears(tmp_path) -> None:
    """`benchmarks/bench_decode_graphs.py --linear-weights checkpoint` (the GPU A/B against bf16
    linears) runs end to end on the CPU, and its read floor counts the FP8 bytes."""
    from benchmarks import bench_decode_graphs as decode_graphs
    from benchmarks import engine_setup as es

    out = tmp_path / "decode.json"
    argv = ["--dry-run", "--out", str(out), "--only", "plain", "--variants", "",
            "--linear-weights", "checkpoint"]  # fmt: skip
    assert decode_graphs.main(argv) == 0
    records = json.loads(out.read_text())
    assert records and all("linears=fp8" in r["shape"] for r in records)
    cfg = es.model_config("0,4,128,4", 8, True, linear_weights="checkpoint")
    model, _ = es.build_model(cfg, True, linear_weights="checkpoint")
    dense, _ = es.build_model(es.model_config("0,4,128,4", 8, True), True)
    fp8 = sum(m.weight.numel() for m in _fp8_modules(model).values())
    scales = sum(m.scale.numel() for m in _fp8_modules(model).values())
    assert es.param_bytes(dense)[0] - es.param_bytes(model)[0] == fp8 - scales  # 2 B -> 1 B
