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

from dsv4.ops.quant import fp8_block_dequantize, fp8_block_quantize
from kernels.fp8_linear import (
    fp8_grouped_linear,
    fp8_grouped_linear_ref,
    fp8_linear,
    fp8_linear_ref,
)
from kernels.fp8_splitk import tile_counters
from tests.kernels.bench_dry_run import dry_run_records
from tests.kernels.tolerances import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TILED = {"GEMV": False, "DEQUANT": False}  # the tiled tl.dot kernel, at any row count


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
    y = fp8_linear(x, w, s, tune={"splits": splits, **TILED})
    assert_close(y, fp8_linear_ref(x, w, s), "activation")


@pytest.mark.parametrize("rows,splits", [(1, 2), (17, 1)])
def test_fp8_linear_post_scale_matches_ref(rows, splits):
    """POST_SCALE: the UE8M0 scale multiplies each K step's sums instead of the weight tile."""
    w, s = _weight(130, 300, torch.float8_e8m0fnu, rows + 20)
    x = _x((rows, 300), torch.bfloat16, rows + 21)
    y = fp8_linear(x, w, s, tune={"splits": splits, "POST_SCALE": True, **TILED})
    assert_close(y, fp8_linear_ref(x, w, s), "activation")
    g = _x((2, 3, 2, 260), torch.bfloat16, 22)
    wg, sg = _weight(2 * 40, 260, torch.float8_e8m0fnu, 23)
    assert_close(fp8_grouped_linear(g, wg, sg, tune={"POST_SCALE": True, **TILED}),
                 fp8_grouped_linear_ref(g, wg, sg), "activation")  # fmt: skip


@pytest.mark.parametrize("post_scale", [False, True], ids=["w_scale", "post_scale"])
@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32], ids=["e8m0", "f32"])
@pytest.mark.parametrize("rows,splits", [(1, 3), (17, 1)])
def test_fp8_linear_swap_ab_matches_ref(rows, splits, scale_dtype, post_scale):
    """SWAP_AB: the weight tile on the dot's left, the transposed tile stored back."""
    w, s = _weight(130, 300, scale_dtype, rows + 30)
    x = _x((rows, 300), torch.bfloat16, rows + 31)
    tune = {"splits": splits, "SWAP_AB": True, "POST_SCALE": post_scale, "BLOCK_N": 64, **TILED}
    assert_close(fp8_linear(x, w, s, tune=tune), fp8_linear_ref(x, w, s), "activation")
    g = _x((2, 3, 2, 260), torch.bfloat16, rows + 32)
    wg, sg = _weight(2 * 40, 260, scale_dtype, rows + 33)
    assert_close(fp8_grouped_linear(g, wg, sg, tune=tune), fp8_grouped_linear_ref(g, wg, sg),
                 "activation")  # fmt: skip


@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32], ids=["e8m0", "f32"])
def test_fp8_dequantize_is_the_reference_weight(scale_dtype):
    """The one-pass dequantiser writes the very bf16 values `fp8_block_dequantize` does."""
    fp8 = importlib.import_module("kernels.fp8_linear")
    w, s = _weight(170, 300, scale_dtype, 40)
    assert torch.equal(fp8.fp8_dequantize(w, s, torch.bfloat16),
                       fp8_block_dequantize(w, s, 128, torch.bfloat16))  # fmt: skip
    assert torch.equal(fp8.fp8_dequantize(w, s, torch.float32),
                       fp8_block_dequantize(w, s, 128, torch.float32))  # fmt: skip


@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32], ids=["e8m0", "f32"])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows,splits", [(1, 1), (1, 3), (5, 2), (16, 1)])
def test_fp8_gemv_matches_ref(rows, splits, x_dtype, scale_dtype):
    """The decode GEMV (kernels/fp8_gemv.py): odd N and K, a row tile wider than the rows, K
    split across programs; fp32 scales scale every element as the dequantised weight does."""
    w, s = _weight(130, 300, scale_dtype, rows + 50)
    x = _x((rows, 300), x_dtype, rows + 51)
    y = fp8_linear(x, w, s, tune={"GEMV": True, "splits": splits})
    assert y.dtype == x_dtype
    assert_close(y, fp8_linear_ref(x, w, s), "activation")
    g = _x((1, rows, 2, 260), x_dtype, rows + 52)
    wg, sg = _weight(2 * 40, 260, scale_dtype, rows + 53)
    assert_close(fp8_grouped_linear(g, wg, sg, tune={"GEMV": True, "splits": splits}),
                 fp8_grouped_linear_ref(g, wg, sg), "activation")  # fmt: skip


@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32], ids=["e8m0", "f32"])
@pytest.mark.parametrize("rows,splits", [(1, 1), (2, 3), (4, 2)])
def test_gemv_rowtile_matches_ref(rows, splits, scale_dtype):
    """Issue 21's GEMV candidate (STEP_BYTES: few weight rows a program, K whole) at 1-4 rows,
    and K split with the partials added in the same launch (REDUCE "kernel"): the counters are
    back at zero after the launch and a second run gives the same bits."""
    w, s = _weight(130, 300, scale_dtype, rows + 60)
    x = _x((rows, 300), torch.bfloat16, rows + 61)
    tune = {"GEMV": True, "STEP_BYTES": 16384, "splits": splits}
    y = fp8_linear(x, w, s, tune=tune)
    assert_close(y, fp8_linear_ref(x, w, s), "activation")
    assert torch.equal(y, fp8_linear(x, w, s, tune=tune))
    assert not tile_counters(x.device).any()
    g = _x((1, rows, 2, 260), torch.bfloat16, rows + 62)
    wg, sg = _weight(2 * 40, 260, scale_dtype, rows + 63)
    assert_close(fp8_grouped_linear(g, wg, sg, tune=tune), fp8_grouped_linear_ref(g, wg, sg),
                 "activation")  # fmt: skip


@pytest.mark.parametrize("tune", [{"GEMV": True, "BLOCK_N": 32}, {**TILED, "BLOCK_N": 64},
                                  {**TILED, "SWAP_AB": True, "POST_SCALE": True, "BLOCK_N": 64}],
                         ids=["gemv_rows", "tiled", "tiled_swap"])  # fmt: skip
def test_in_kernel_split_reduce_matches_ref(tune):
    """REDUCE "kernel" in the 2+ row GEMV and the tiled kernel (plain and SWAP_AB: the
    transposed tile): the tile's last program adds the partials in split order."""
    w, s = _weight(130, 300, torch.float8_e8m0fnu, 70)
    x = _x((3, 300), torch.bfloat16, 71)
    tune = {**tune, "splits": 3, "REDUCE": "kernel"}
    y = fp8_linear(x, w, s, tune=tune)
    assert_close(y, fp8_linear_ref(x, w, s), "activation")
    assert torch.equal(y, fp8_linear(x, w, s, tune={**tune, "REDUCE": "pass"}))  # same order
    assert not tile_counters(x.device).any()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels compile as they run")
def test_in_kernel_reduce_compiles_for_sm90(monkeypatch):
    """The in-launch split-K reduction (atomics, a data-dependent branch) of every FP8 linear
    kernel compiles for sm_90: recorded here on their own, since the directory-wide check keeps
    only each kernel's first variants."""
    sm90 = importlib.import_module("tests.kernels.sm90_build")
    monkeypatch.setattr(sm90, "RECORDED", {})
    w, s = _weight(130, 256, torch.float8_e8m0fnu, 80)
    for rows, tune, acts in (
        (1, {"GEMV": True, "STEP_BYTES": 16384, "splits": 2}, "bf16"),
        (3, {"GEMV": True, "splits": 2, "REDUCE": "kernel"}, "bf16"),
        (3, {**TILED, "SWAP_AB": True, "POST_SCALE": True, "splits": 2, "REDUCE": "kernel"}, "bf16"),
        (3, {"GEMV": False, "W8A8": True, "splits": 2, "REDUCE": "kernel"}, "fp8"),
    ):  # fmt: skip
        fp8_linear(_x((rows, 256), torch.bfloat16, 81), w, s, acts, tune=tune)
    launches = [launch for kept in sm90.RECORDED.values() for launch in kept]
    reduce = [dict(launch.constexprs).get("IN_KERNEL_REDUCE") for launch in launches]
    assert reduce.count(True) == 4, reduce
    failures = sm90.compile_recorded([la for la, r in zip(launches, reduce, strict=True) if r])
    assert not failures, "\n".join(failures)


def test_gemv_rowtile_config_fills_the_gpu_without_splitting(monkeypatch):
    """On a 132-SM GPU the row-tile GEMV gives every V4-Flash linear >= 2 programs an SM at 1-4
    rows with K whole (one launch), shrinking the weight rows a program to do so."""
    fp8_gemv = importlib.import_module("kernels.fp8_gemv")
    monkeypatch.setattr(fp8_gemv, "num_sms", lambda index: 132)
    for rows in (1, 2, 4):
        for n, k, groups in ((512, 4096, 1), (1024, 4096, 1), (32768, 1024, 1), (4096, 8192, 1),
                             (2048, 4096, 1), (4096, 2048, 1), (1024, 4096, 8)):  # fmt: skip
            cfg = fp8_gemv.gemv_rowtile_config(rows, n, k, groups, torch.device("cuda", 0), 16384)
            assert cfg["splits"] == 1 and -(-n // cfg["BLOCK_N"]) * groups >= 2 * 132
            assert cfg["BLOCK_T"] * cfg["BLOCK_N"] * cfg["BLOCK_K"] <= 16384


def test_row_count_picks_the_path(monkeypatch):
    """`exact_path`: the GEMV at 1 row (and 2 for narrow linears), the tiled kernel to 16 rows
    (narrow) or 64 (wide), dequantise + F.linear above (the reference's own computation: equal,
    not just close)."""
    fp8 = importlib.import_module("kernels.fp8_linear")
    assert [fp8.exact_path(r, 1024, 1) for r in (1, 2, 3, 16, 17)] == \
        ["rowtile", "rowtile", "tiled", "tiled", "dequant"]  # fmt: skip
    assert [fp8.exact_path(r, 1024, 8) for r in (1, 2, 64, 65)] == \
        ["rowtile", "tiled", "tiled", "dequant"]  # fmt: skip
    calls = []
    for name in ("fp8_dequantize", "launch_gemv", "_fp8_linear_kernel"):
        real = getattr(fp8, name)
        if name == "_fp8_linear_kernel":  # a launcher object: wrap its [grid] indexing
            monkeypatch.setattr(fp8, name, _Recording(real, calls))
        else:
            monkeypatch.setattr(fp8, name, lambda *a, _f=real, _n=name: calls.append(_n) or _f(*a))
    w, s = _weight(130, 300, torch.float8_e8m0fnu, 41)  # narrow (130 <= NARROW_N)
    x = _x((17, 300), torch.bfloat16, 42)
    assert torch.equal(fp8_linear(x, w, s), fp8_linear_ref(x, w, s))
    assert calls == ["fp8_dequantize"]
    for rows, path in ((16, "_fp8_linear_kernel"), (2, "launch_gemv"), (1, "launch_gemv")):
        calls.clear()
        assert_close(fp8_linear(x[:rows], w, s), fp8_linear_ref(x[:rows], w, s), "activation")
        assert calls == [path]
    monkeypatch.setattr(fp8, "NARROW_N", 64)  # the same weight as a wide linear
    for rows, path in ((17, "_fp8_linear_kernel"), (2, "_fp8_linear_kernel")):
        calls.clear()
        assert_close(fp8_linear(x[:rows], w, s), fp8_linear_ref(x[:rows], w, s), "activation")
        assert calls == [path]
    calls.clear()
    wg, sg = _weight(2 * 40, 260, torch.float32, 43)
    g = _x((2, 33, 2, 260), torch.bfloat16, 44)  # 66 rows
    y = fp8_grouped_linear(g, wg, sg)
    assert calls == ["fp8_dequantize"] and y.shape == (2, 33, 2, 40)
    assert_close(y, fp8_grouped_linear_ref(g, wg, sg), "activation")


class _Recording:
    """A Triton kernel whose launches are counted (`kernel[grid](...)`)."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append("_fp8_linear_kernel")
        return self.kernel[grid]


def test_fp8_linear_fp32_leading_dims_and_strided_rows():
    """An fp32 model (CPU reference runs) keeps fp32; [B, S, K] inputs and row-strided views."""
    w, s = _weight(72, 200, torch.float8_e8m0fnu, 3)
    x = _x((2, 3, 200), torch.float32, 4)
    y = fp8_linear(x, w, s, tune={"splits": 2, **TILED})
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
    y = fp8_grouped_linear(x, w, s, tune={"splits": splits, **TILED})
    assert y.shape == (2, 3, 2, 40)
    assert_close(y, fp8_grouped_linear_ref(x, w, s), "activation")


def test_split_choice_fills_the_gpu_for_decode_only(monkeypatch):
    """The config a 132-SM GPU gets: decode GEMVs split K until the grid covers the SMs (and no
    further than 2 K steps a split); large prefills run one split."""
    fp8 = importlib.import_module("kernels.fp8_linear")  # `kernels.fp8_linear` is the op
    monkeypatch.setattr(fp8, "num_sms", lambda index: 132)
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
        gemv = ({"GEMV": True}, {"GEMV": True, "STEP_BYTES": 16384}) if rows <= 16 else ()
        for tune in (TILED, {**TILED, "POST_SCALE": True}, {**TILED, "SWAP_AB": True},
                     {"GEMV": False, "DEQUANT": True}, {**TILED, "splits": 2, "REDUCE": "kernel"},
                     *gemv):  # fmt: skip
            assert_close(fp8_linear(x, w, s, tune=tune), fp8_linear_ref(x, w, s), "activation")
    w, s = _weight(8 * 1024, 4096, torch.float32, 8)
    x = _x((rows, 8, 4096), torch.bfloat16, 9)
    assert_close(fp8_grouped_linear(x, w, s), fp8_grouped_linear_ref(x, w, s), "activation")
    for tune in (TILED, {"GEMV": rows <= 16}):
        assert_close(fp8_grouped_linear(x, w, s, tune=tune), fp8_grouped_linear_ref(x, w, s),
                     "activation")  # fmt: skip


@pytest.mark.gpu
def test_fp8_linear_is_graph_capturable_gpu():
    w, s = _weight(1024, 4096, torch.float8_e8m0fnu, 10)
    x = _x((4, 4096), torch.bfloat16, 11)
    for tune in (TILED, {"GEMV": True}, {"GEMV": False, "DEQUANT": True}):
        want = fp8_linear(x, w, s, tune=tune)  # warm: compiled before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = fp8_linear(x, w, s, tune=tune)
        graph.replay()
        assert torch.equal(y, want)


def test_benchmark_dry_run(tmp_path):
    """`python -m benchmarks.bench_kernels_linear --dry-run` (CPU, tiny shapes) writes records."""
    records = dry_run_records(tmp_path, "bench_kernels_linear")
    names = {"fp8_linear", "fp8_grouped_linear", "fp8_linear_tile", "fp8_linear_gemv"}
    assert {r["name"] for r in records} == names
