"""The W8A8 path through torch's block-scaled FP8 GEMM (kernels/fp8_linear_cublas.py).

cuBLASLt's block-scaled GEMM runs only on sm_90, so on CPU these tests check what feeds it:
the 1x128 quantiser's codes and scales (against the torch reference), the operands' shapes and
strides (against torch's own meta-device checks of both APIs), and an fp32 emulation of the
block-scaled product read through those strided operands (against the W8A8 reference). The
`gpu` tests run the real call against the same reference and the exact path.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from dsv4.ops.fp8 import quantize_activations as quantize_ref
from kernels import fp8_linear_cublas as cublas
from kernels.fp8_linear import (
    fp8_grouped_linear,
    fp8_grouped_linear_ref,
    fp8_linear,
    fp8_linear_ref,
)
from tests.kernels.fp8_inputs import DEVICE, activations, fp8_weight
from tests.kernels.tolerances import assert_close

CUBLAS = {"GEMV": False, "CUBLAS": True}
fp8 = importlib.import_module("kernels.fp8_linear")  # the package exports a same-named op
BOTH = [a for a in cublas.APIS if a in cublas.available_apis()]


def _emulate(a, b, scale_a, scale_b):
    """The block-scaled product cuBLASLt computes, in fp32, read through the operands as passed:
    y[m, n] = sum_j scale_a[m, j] * scale_b[j, n // 128] * (a[m, 128j:128j+128] . b[128j:, n])."""
    kb = a.shape[1] // 128
    parts = torch.einsum("mjc,jcn->jmn", a.float().unflatten(1, (kb, 128)),
                         b.float().unflatten(0, (kb, 128)))  # fmt: skip
    sb = scale_b[:kb].repeat_interleave(128, dim=1)  # [kb, N]
    return (parts * scale_a.t()[:, :, None] * sb[:, None, :]).sum(0)


def _emulated_linear(x, weight, scale, api):
    """y [T, G, N] from the module's own operands (quantiser, layouts, group views)."""
    q, s = cublas.quantize_activations_t(x)
    scale_b = cublas.weight_scale_operand(scale, api)
    ys = [_emulate(*cublas.gemm_operands(q, s, weight, scale_b, g)) for g in range(x.shape[1])]
    return torch.stack(ys, dim=1)[: x.shape[0]].to(x.dtype)


def _meta(t):
    """t's shape, strides and dtype on the meta device (`.to("meta")` would densify views)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def test_quantizer_layout_matches_reference():
    """Codes and scales as dsv4.ops.fp8.quantize_activations has them, the scales stored
    [G, K/128, T_pad] (outer-dim-major per group), rows past T zero; a zero row, an outlier."""
    x = activations((5, 2, 384), 1)
    x[1, 0] = 0
    x[2, 1, :128] *= 300
    q, s = cublas.quantize_activations_t(x)
    assert q.shape == (16, 2, 384) and s.shape == (2, 3, 16) and s.is_contiguous()
    q_ref, s_ref = quantize_ref(x)  # [5, 2, 384], [5, 2, 3]
    torch.testing.assert_close(s[:, :, :5].permute(2, 0, 1), s_ref, rtol=2e-7, atol=0)
    assert (q[:5].float() - q_ref.float()).abs().gt(0).float().mean() < 1e-3  # ties aside
    assert q[5:].float().abs().sum() == 0
    a, _, scale_a, _ = cublas.gemm_operands(q, s, torch.empty(256, 384).to(q.dtype),
                                            torch.ones(4, 4).t(), 1)  # fmt: skip
    assert a.shape == (16, 384) and a.stride() == (768, 1)  # row-major, row stride G*K
    assert scale_a.shape == (16, 3) and scale_a.stride() == (1, 16)  # outer-dim-major


@pytest.mark.parametrize("api,kb,width", [("scaled_mm", 3, 4), ("_scaled_mm", 3, 3),
                                          ("scaled_mm", 8, 8)])  # fmt: skip
def test_weight_scale_operand_layout_and_cache(api, kb, width):
    """fp32 [L, N/128] with strides (1, L): the stored scale transposed, zero-padded to L
    (a multiple of 4 for "scaled_mm"); laid out once, again after an in-place write."""
    _, scale = fp8_weight(256, 128 * kb, kb)  # UE8M0 [2, kb]
    op = cublas.weight_scale_operand(scale, api)
    assert op.dtype == torch.float32 and op.shape == (width, 2) and op.stride() == (1, width)
    torch.testing.assert_close(op[:kb].t(), scale.float(), rtol=0, atol=0)
    assert op[kb:].abs().sum() == 0
    assert cublas.weight_scale_operand(scale, api) is op  # cached, not per call
    scale.view(torch.uint8).add_(1)  # in place: the version moves, the layout is redone
    again = cublas.weight_scale_operand(scale, api)
    assert again is not op and torch.equal(again[:kb].t(), scale.float())


@pytest.mark.parametrize("api", BOTH)
@pytest.mark.parametrize("groups,rows,k", [(1, 5, 384), (1, 64, 512), (2, 17, 256)])
def test_operands_pass_torch_layout_checks(api, groups, rows, k):
    """The operands as passed, on the meta device, through the API's own shape/stride checks
    (F.scaled_mm checks strides there; _scaled_mm shapes): [T_pad, N] bf16 comes back."""
    x = activations((rows, groups, k), rows)
    w, s = fp8_weight(groups * 256, k, k)
    q, sa = cublas.quantize_activations_t(x)
    scale_b = cublas.weight_scale_operand(s, api)
    for g in range(groups):
        ops = [_meta(t) for t in cublas.gemm_operands(q, sa, w, scale_b, g)]
        y = cublas._call(api, *ops, torch.bfloat16)
        assert y.shape == (q.shape[0], 256) and y.dtype == torch.bfloat16
    if api == "scaled_mm":  # a row-major scale_a is what the checks refuse
        a, b, scale_a, sb = (_meta(t) for t in cublas.gemm_operands(q, sa, w, scale_b, 0))
        with pytest.raises(RuntimeError, match="1x128 x 128x128"):
            cublas._call(api, a, b, _meta(scale_a.contiguous()), sb, torch.bfloat16)


@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32], ids=["e8m0", "f32"])
@pytest.mark.parametrize("api", cublas.APIS)
@pytest.mark.parametrize("groups,rows,k", [(1, 5, 384), (1, 64, 512), (2, 17, 256)])
def test_emulated_product_matches_w8a8_reference(groups, rows, k, api, scale_dtype):
    """The block-scaled product over the module's operands equals the W8A8 reference (x
    quantised per 1x128 group, both operands dequantised, an fp32 product) up to bf16 rounding."""
    x = activations((rows, groups, k), rows + k)
    w, s = fp8_weight(groups * 256, k, groups + rows, scale_dtype)
    y = _emulated_linear(x, w, s, api)
    if groups == 1:
        assert_close(y[:, 0], fp8_linear_ref(x[:, 0], w, s, "fp8"), "activation")
    else:
        assert_close(y, fp8_grouped_linear_ref(x, w, s, "fp8"), "activation")


def test_dispatch_names_the_path():
    """`w8a8_path`: the block-scaled GEMM from CUBLAS_W8A8_MIN_ROWS (grouped: its own bound)
    where supported, the Triton W8A8 at 3-64 rows otherwise, the exact paths outside; on CPU the
    switch keeps the Triton kernel (`supported` is False)."""
    assert fp8.w8a8_path(fp8.CUBLAS_W8A8_MIN_ROWS, 1024, 1, True) == "w8a8_cublas"
    assert fp8.w8a8_path(fp8.CUBLAS_W8A8_MIN_ROWS - 1, 1024, 1, True) == "w8a8"
    assert fp8.w8a8_path(1024, 512, 1, True) == "dequant"  # N 512 (wkv): the exact path
    assert fp8.w8a8_path(64, 1024, 1, False) == "w8a8"
    assert fp8.w8a8_path(1024, 1024, 1, False) == "dequant"
    assert fp8.w8a8_path(1, 1024, 1, True) == "rowtile"
    assert fp8.w8a8_path(fp8.CUBLAS_W8A8_GROUPED_MIN_ROWS, 1024, 8, True) == "w8a8_cublas"
    assert fp8.w8a8_path(fp8.CUBLAS_W8A8_GROUPED_MIN_ROWS - 1, 1024, 8, True) == "dequant"
    w, s = fp8_weight(256, 256, 3)
    x = activations((64, 256), 4)
    assert not cublas.supported(x.cpu(), 256, 256)
    assert not cublas.supported(x, 130, 256) and not cublas.supported(x, 256, 200)
    if DEVICE == "cpu":
        assert_close(fp8_linear(x, w, s, "fp8"), fp8_linear_ref(x, w, s, "fp8"), "activation")
        # cuBLAS cannot run here: the forced path says so with its typed error
        with pytest.raises(cublas.BlockScaledMMUnavailable, match="block-scaled"):
            fp8_linear(x, w, s, "fp8", tune=CUBLAS)


def test_typed_errors(monkeypatch):
    """No block-scaled API in this torch, or scale blocks that do not tile the weight: a
    BlockScaledMMUnavailable naming the cause."""
    w, s = fp8_weight(256, 256, 5)
    x = activations((4, 1, 256), 6)
    monkeypatch.setattr(cublas, "_API_IN_USE", [])
    monkeypatch.setattr(cublas, "available_apis", lambda: ())
    with pytest.raises(cublas.BlockScaledMMUnavailable, match="neither"):
        cublas.w8a8_cublas(x, w, s)
    w2, s2 = fp8_weight(130, 256, 7)
    with pytest.raises(cublas.BlockScaledMMUnavailable, match="multiples of 128"):
        cublas.w8a8_cublas(x, w2, s2)


# V4-Flash: wkv, wq_a, wq_b, wo_b, the shared expert's w1 / w2, e_proj
SHAPES = ((512, 4096), (1024, 4096), (32768, 1024), (4096, 8192), (2048, 4096), (4096, 2048),
          (4096, 4096))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64, 65, 1024, 4096])
def test_w8a8_cublas_production_shapes_gpu(rows):
    """The real block-scaled GEMM against the W8A8 reference (the Triton W8A8 test's tolerance),
    within the W8A8 error of the exact path, deterministic; wo_a's 8 groups too."""
    for n, k in SHAPES:
        for scale_dtype in (torch.float8_e8m0fnu, torch.float32):
            w, s = fp8_weight(n, k, n + rows, scale_dtype)
            x = activations((rows, k), k + rows)
            y = fp8_linear(x, w, s, "fp8", tune=CUBLAS)
            assert_close(y, fp8_linear_ref(x, w, s, "fp8"), "activation")
            exact = fp8_linear(x, w, s)
            rel = ((y.float() - exact.float()).norm() / exact.float().norm()).item()
            assert rel < 0.05, (n, k, rel)  # W8A8's ~2.6% (docs/BENCHMARKS.md)
            assert torch.equal(y, fp8_linear(x, w, s, "fp8", tune=CUBLAS))
    w, s = fp8_weight(8 * 1024, 4096, 8)
    x = activations((rows, 8, 4096), 9)
    assert_close(fp8_grouped_linear(x, w, s, "fp8", tune=CUBLAS),
                 fp8_grouped_linear_ref(x, w, s, "fp8"), "activation")  # fmt: skip
    assert cublas._API_IN_USE, "an API ran"


@pytest.mark.gpu
def test_w8a8_cublas_dispatch_and_graph_gpu():
    """The switch takes the path from CUBLAS_W8A8_MIN_ROWS on sm_90; one CUDA graph replays it."""
    w, s = fp8_weight(1024, 4096, 10)
    x = activations((max(fp8.CUBLAS_W8A8_MIN_ROWS, 256), 4096), 11)
    assert cublas.supported(x, 1024, 4096) == (torch.cuda.get_device_capability() == (9, 0))
    if not cublas.supported(x, 1024, 4096):
        pytest.skip("block-scaled FP8 GEMM needs sm_90")
    want = fp8_linear(x, w, s, "fp8", tune=CUBLAS)
    assert torch.equal(fp8_linear(x, w, s, "fp8"), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_linear(x, w, s, "fp8")
    graph.replay()
    assert torch.equal(y, want)
