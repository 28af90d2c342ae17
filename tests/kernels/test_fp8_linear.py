"""fp8_linear / fp8_grouped_linear (kernels/fp8_linear.py) against their references (dequantise
the e4m3 weight with its 128x128 block scales, then F.linear / the grouped einsum).

Both sides multiply the same dequantised weights (UE8M0: exact in bf16; fp32 scales: both round
the product to bf16 once) with fp32 accumulation, so only summation order differs: the split-K
partials add in split order. Odd shapes (N, K not multiples of 128, a group not starting on a
scale block) exercise the masks and the scale indexing.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from dsv4.model.quant import fp8_block_quantize
from kernels.fp8_linear import (
    fp8_grouped_linear,
    fp8_grouped_linear_ref,
    fp8_linear,
    fp8_linear_ref,
)
from tests.kernels.tolerances import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(n, k, scale_dtype, seed):
    """(e4m3 [n, k], scales [ceil(n/128), ceil(k/128)]): UE8M0, or fp32 not powers of two
    (the -Base checkpoints' kind)."""
    g = torch.Generator(DEVICE).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=DEVICE) / k**0.5
    codes, scale = fp8_block_quantize(w)
    if scale_dtype == torch.float32:
        scale = scale.float() * (1 + torch.rand(scale.shape, generator=g, device=DEVICE))
    return codes, scale


def _x(shape, dtype, seed):
    g = torch.Generator(DEVICE).manual_seed(seed)
    return torch.randn(shape, generator=g, device=DEVICE).to(dtype)


@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32], ids=["e8m0", "f32"])
@pytest.mark.parametrize("rows,splits", [(1, 1), (1, 3), (3, 2), (17, 1), (17, 3)])
def test_fp8_linear_matches_ref_on_odd_shapes(rows, splits, scale_dtype):
    w, s = _weight(130, 300, scale_dtype, rows)
    x = _x((rows, 300), torch.bfloat16, rows + 1)
    y = fp8_linear(x, w, s, tune={"splits": splits})
    assert_close(y, fp8_linear_ref(x, w, s), "activation")


@pytest.mark.parametrize("rows,splits", [(1, 2), (17, 1)])
def test_fp8_linear_post_scale_matches_ref(rows, splits):
    """POST_SCALE: the UE8M0 scale multiplies each K step's sums instead of the weight tile."""
    w, s = _weight(130, 300, torch.float8_e8m0fnu, rows + 20)
    x = _x((rows, 300), torch.bfloat16, rows + 21)
    y = fp8_linear(x, w, s, tune={"splits": splits, "POST_SCALE": True})
    assert_close(y, fp8_linear_ref(x, w, s), "activation")
    g = _x((2, 3, 2, 260), torch.bfloat16, 22)
    wg, sg = _weight(2 * 40, 260, torch.float8_e8m0fnu, 23)
    assert_close(fp8_grouped_linear(g, wg, sg, tune={"POST_SCALE": True}),
                 fp8_grouped_linear_ref(g, wg, sg), "activation")  # fmt: skip


def test_fp8_linear_fp32_leading_dims_and_strided_rows():
    """An fp32 model (CPU reference runs) keeps fp32; [B, S, K] inputs and row-strided views."""
    w, s = _weight(72, 200, torch.float8_e8m0fnu, 3)
    x = _x((2, 3, 200), torch.float32, 4)
    y = fp8_linear(x, w, s, tune={"splits": 2})
    assert y.shape == (2, 3, 72)
    assert_close(y, fp8_linear_ref(x, w, s), "activation")
    wide = _x((5, 400), torch.bfloat16, 5)[:, :200]  # row stride 400
    assert_close(fp8_linear(wide, w, s), fp8_linear_ref(wide, w, s), "activation")
    assert fp8_linear(wide[:0], w, s).shape == (0, 72)


@pytest.mark.parametrize("splits", [1, 2])
def test_fp8_grouped_linear_matches_ref(splits):
    """attn.wo_a: 2 groups of 40 rows (group 1 starts inside scale block 0), x [B, S, G, K]."""
    w, s = _weight(2 * 40, 260, torch.float8_e8m0fnu, 6)
    x = _x((2, 3, 2, 260), torch.bfloat16, 7)
    y = fp8_grouped_linear(x, w, s, tune={"splits": splits})
    assert y.shape == (2, 3, 2, 40)
    assert_close(y, fp8_grouped_linear_ref(x, w, s), "activation")


def test_split_choice_fills_the_gpu_for_decode_only(monkeypatch):
    """The config a 132-SM GPU gets: decode GEMVs split K until the grid covers the SMs (and no
    further than 2 K steps a split); large prefills run one split."""
    fp8 = importlib.import_module("kernels.fp8_linear")  # `kernels.fp8_linear` is the op
    monkeypatch.setattr(fp8, "_num_sms", lambda index: 132)
    gpu = torch.device("cuda", 0)
    for n, k in ((512, 4096), (1024, 4096), (4096, 8192)):  # wkv, wq_a, wo_b of V4-Flash
        cfg = fp8._config(1, n, k, 1, gpu)
        tiles, half_steps = -(-n // cfg["BLOCK_N"]), k // cfg["BLOCK_K"] // 2
        assert cfg["splits"] <= half_steps
        assert tiles * cfg["splits"] >= 132 or cfg["splits"] == half_steps
    assert fp8._config(8192, 1024, 4096, 1, gpu)["splits"] == 1
    assert fp8._config(1, 32768, 1024, 1, gpu)["splits"] == 1  # wq_b: tiles enough
    assert fp8._config(1024, 512, 4096, 1, gpu)["splits"] <= 4  # partials stay small


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64, 1024, 4096])
def test_fp8_linear_production_shapes_gpu(rows):
    """V4-Flash: wkv, wq_a, wq_b, wo_b, the shared expert's w2, and wo_a (8 groups)."""
    for n, k in ((512, 4096), (1024, 4096), (32768, 1024), (4096, 8192), (4096, 2048)):
        w, s = _weight(n, k, torch.float8_e8m0fnu, n)
        x = _x((rows, k), torch.bfloat16, k)
        y = fp8_linear(x, w, s)
        assert_close(y, fp8_linear_ref(x, w, s), "activation")
        assert torch.equal(y, fp8_linear(x, w, s))  # deterministic: no atomics
        post = fp8_linear(x, w, s, tune={"POST_SCALE": True})
        assert_close(post, fp8_linear_ref(x, w, s), "activation")
    w, s = _weight(8 * 1024, 4096, torch.float32, 8)
    x = _x((rows, 8, 4096), torch.bfloat16, 9)
    assert_close(fp8_grouped_linear(x, w, s), fp8_grouped_linear_ref(x, w, s), "activation")


@pytest.mark.gpu
def test_fp8_linear_is_graph_capturable_gpu():
    w, s = _weight(1024, 4096, torch.float8_e8m0fnu, 10)
    x = _x((4, 4096), torch.bfloat16, 11)
    want = fp8_linear(x, w, s)  # warm: compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_linear(x, w, s)
    graph.replay()
    assert torch.equal(y, want)


def test_benchmark_dry_run(tmp_path):
    """benchmarks/kernels_linear.py --dry-run (CPU, tiny shapes, references) writes its records."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels_linear.py"
    spec = importlib.util.spec_from_file_location("bench_kernels_linear", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "l.json"
    assert bench.main(["--dry-run", "--out", str(out)]) == 0
    records = json.loads(out.read_text())
    assert {r["name"] for r in records} == {"fp8_linear", "fp8_grouped_linear", "fp8_linear_tile"}
