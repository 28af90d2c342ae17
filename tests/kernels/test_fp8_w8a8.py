"""W8A8 FP8 linears (kernels/fp8_w8a8.py) against their torch reference (dsv4.model.fp8: x
quantised per 1x128 group, both operands dequantised, an fp32 product), and the 1x128 quantiser
against `quantize_activations` bit for bit. Odd shapes (N, K not multiples of 128, a K tail
group, a group of wo_a not starting on a scale block) exercise the masks and scale indexing.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from dsv4.config import load_config
from dsv4.errors import ConfigError
from dsv4.model.fp8 import FP8Linear, set_linear_activations_
from dsv4.ops.fp8 import quantize_activations as quantize_ref
from kernels.fp8_linear import (
    fp8_grouped_linear,
    fp8_grouped_linear_ref,
    fp8_linear,
    fp8_linear_ref,
)
from kernels.fp8_w8a8 import quantize_activations
from tests.kernels.fp8_inputs import DEVICE, activations, fp8_weight
from tests.kernels.tolerances import assert_close

W8A8 = {"GEMV": False, "W8A8": True}


def test_quantizer_matches_reference_bit_for_bit():
    """e4m3 codes and fp32 scales as the torch reference has them, with a zero row and a K
    tail of 44 columns (its own scale)."""
    x = activations((5, 2, 300), 1)
    x[1, 0] = 0
    x[2, 1, :128] *= 300  # a group far from the others: its own scale
    q, s = quantize_activations(x)
    q_ref, s_ref = quantize_ref(x)
    assert s.shape == (5, 2, 3)
    torch.testing.assert_close(s, s_ref, rtol=2e-7, atol=0)  # amax / 448: one fp32 division
    assert (q.float() - q_ref.float()).abs().gt(0).float().mean() < 1e-3  # rounding ties aside


@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32], ids=["e8m0", "f32"])
@pytest.mark.parametrize("fuse", [False, True], ids=["quant_kernel", "fused"])
@pytest.mark.parametrize("reduce", ["pass", "kernel"])
@pytest.mark.parametrize("rows,splits,swap", [(3, 2, True), (17, 1, True), (40, 3, False)])
def test_w8a8_matches_ref(rows, splits, swap, fuse, scale_dtype, reduce):
    """REDUCE "kernel": split-K partials added by the tile's last program (kernels/fp8_splitk.py)."""
    w, s = fp8_weight(130, 300, rows, scale_dtype)
    x = activations((rows, 300), rows + 1)
    tune = {**W8A8, "splits": splits, "SWAP_AB": swap, "FUSE_QUANT": fuse, "REDUCE": reduce}
    y = fp8_linear(x, w, s, "fp8", tune=tune)
    assert_close(y, fp8_linear_ref(x, w, s, "fp8"), "activation")
    g = activations((2, 3, 2, 260), rows + 2)
    wg, sg = fp8_weight(2 * 40, 260, rows + 3, scale_dtype)
    assert_close(fp8_grouped_linear(g, wg, sg, "fp8", tune=tune),
                 fp8_grouped_linear_ref(g, wg, sg, "fp8"), "activation")  # fmt: skip


def test_activations_switch_picks_the_path():
    """activations="fp8" runs W8A8 from GEMV_MAX_ROWS + 1 to W8A8_MAX_ROWS rows and the exact
    paths outside (the GEMV below; dequantise + F.linear above: equal to the exact reference)."""
    fp8 = importlib.import_module("kernels.fp8_linear")
    w, s = fp8_weight(130, 256, 7)
    x = activations((8, 256), 8)
    y = fp8_linear(x, w, s, "fp8")
    assert_close(y, fp8_linear_ref(x, w, s, "fp8"), "activation")
    assert not torch.equal(fp8_linear_ref(x, w, s, "fp8"), fp8_linear_ref(x, w, s))
    one = x[:1]
    assert_close(fp8_linear(one, w, s, "fp8"), fp8_linear_ref(one, w, s), "activation")
    many = activations((fp8.W8A8_MAX_ROWS + 1, 256), 9)
    assert torch.equal(fp8_linear(many, w, s, "fp8"), fp8_linear_ref(many, w, s))


def test_fp8_linear_module_serves_its_activations():
    """FP8Linear(activations="fp8") calls the W8A8 op (the torch reference here); a bad value
    is a ConfigError."""
    layer = FP8Linear(256, 130, device=DEVICE, activations="fp8")
    layer.weight.data, layer.scale.data = fp8_weight(130, 256, 12)
    x = activations((3, 256), 13)
    assert torch.equal(layer(x), fp8_linear_ref(x, layer.weight, layer.scale, "fp8"))
    assert "activations=fp8" in repr(layer)
    with pytest.raises(ConfigError):
        FP8Linear(256, 130, device=DEVICE, activations="int8")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64, 1024, 4096])
def test_w8a8_production_shapes_gpu(rows):
    """V4-Flash wkv, wq_a, wq_b, wo_b, shared w2, and wo_a (8 groups), each W8A8 config kind."""
    for n, k in ((512, 4096), (1024, 4096), (32768, 1024), (4096, 8192), (4096, 2048)):
        w, s = fp8_weight(n, k, n)
        x = activations((rows, k), k)
        want = fp8_linear_ref(x, w, s, "fp8")
        for tune in (W8A8, {**W8A8, "FUSE_QUANT": rows > 64}, {**W8A8, "splits": 1}):
            y = fp8_linear(x, w, s, "fp8", tune=tune)
            assert_close(y, want, "activation")
        assert torch.equal(y, fp8_linear(x, w, s, "fp8", tune=tune))  # deterministic
    w, s = fp8_weight(8 * 1024, 4096, 8)
    x = activations((rows, 8, 4096), 9)
    assert_close(fp8_grouped_linear(x, w, s, "fp8", tune=W8A8),
                 fp8_grouped_linear_ref(x, w, s, "fp8"), "activation")  # fmt: skip


@pytest.mark.gpu
def test_w8a8_is_graph_capturable_gpu():
    w, s = fp8_weight(1024, 4096, 10)
    for rows in (16, 256):
        x = activations((rows, 4096), 11)
        for fuse in (False, True):
            tune = {**W8A8, "FUSE_QUANT": fuse}
            want = fp8_linear(x, w, s, "fp8", tune=tune)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = fp8_linear(x, w, s, "fp8", tune=tune)
            graph.replay()
            assert torch.equal(y, want)


def test_linear_activations_switch_reaches_the_modules():
    """`features.linear_activations` (flag, env; bf16 by default; fp8 only with linear_weights
    checkpoint, or auto, which start-up then resolves to checkpoint) sets every FP8Linear's
    activations, as the worker build does after the load."""
    assert load_config({}, None, {}).features.linear_activations == "bf16"
    env = {"DSV4_LINEAR_WEIGHTS": "checkpoint", "DSV4_LINEAR_ACTIVATIONS": "fp8"}
    assert load_config({}, None, env).features.linear_activations == "fp8"
    with pytest.raises(ConfigError, match="linear_activations"):
        load_config({}, None, {"DSV4_LINEAR_ACTIVATIONS": "fp8", "DSV4_LINEAR_WEIGHTS": "bf16"})
    model = torch.nn.Sequential(FP8Linear(256, 130), torch.nn.Linear(4, 4), FP8Linear(128, 64))
    assert set_linear_activations_(model, "fp8") == 2
    assert [m.activations for m in model if isinstance(m, FP8Linear)] == ["fp8", "fp8"]
    with pytest.raises(ConfigError):
        set_linear_activations_(model, "e5m2")


def test_benchmark_dry_run(tmp_path):
    """benchmarks/bench_fp8_linear_vs_bf16.py --dry-run (CPU, tiny shapes, references) writes the
    issue's fp8_linear_vs_bf16 records: every path at every row count, errors included."""
    import json

    from benchmarks import bench_fp8_linear_vs_bf16 as bench

    out = tmp_path / "records.json"
    assert bench.main(["--dry-run", "--out", str(out)]) == 0
    records = json.loads(out.read_text())
    best = [r for r in records if r["name"] == "fp8_linear_best"]
    records = [r for r in records if r["name"] != "fp8_linear_best"]
    keys = {"name", "linear", "rows", "bf16_us", "time_us", "speedup", "pct_roofline", "path"}
    assert all(keys <= set(r) and r["name"] == "fp8_linear_vs_bf16" for r in records)
    cases = {(name, rows) for name in ("wq_a", "wo_a") for rows in (1, 16)}
    assert {(r["linear"], r["rows"]) for r in records} == cases
    # the dispatch table's input: per case the fastest exact path and the fastest of all
    assert sorted((r["linear"], r["rows"], r["activations"]) for r in best) == sorted(
        (*case, acts) for case in cases for acts in ("bf16", "fp8")
    )
    for r in best:
        rivals = [o["time_us"] for o in records if (o["linear"], o["rows"]) == (r["linear"], r["rows"])
                  and (r["activations"] == "fp8" or o["activations"] == "bf16")]  # fmt: skip
        assert r["time_us"] == min(rivals)
    exact = [r for r in records if r["path"] == "exact"]
    assert exact and all(r["rel_err"] == 0 for r in exact)
    assert all(0.01 < r["rel_err"] < 0.05 for r in records if r["path"] == "w8a8")
