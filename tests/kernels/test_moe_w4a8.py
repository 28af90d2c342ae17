"""W4A8 experts (kernels/moe_w4a8.py, `activations="fp8"` of `moe_experts`) against their torch
reference (dsv4/ops/w4a8.py), and the reference against the exact MXFP4 path: what the switch
costs in accuracy, and where it applies."""

from __future__ import annotations

import pytest
import torch

from dsv4.ops.quant import mxfp4_dequantize, mxfp4_quantize
from dsv4.ops.w4a8 import w4a8_weight
from kernels import moe_mxfp4
from kernels.moe import expert_rows, expert_rows_ref, moe_experts, moe_experts_ref, uses_w4a8
from tests.kernels.moe_cases import DEVICE, assert_moe_close, every_code_weights, routing
from tests.kernels.test_moe import _weights

FMT = "mxfp4_halves128"


def _halves(weights):
    w13, w2, s13, s2 = weights
    return moe_mxfp4.repack_halves(w13, 128), moe_mxfp4.repack_halves(w2, 128), s13, s2


def _step(num_tokens, dim, experts, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(num_tokens, dim, generator=g) * 2).bfloat16().to(DEVICE)
    ids, w = routing(num_tokens, experts, k, seed)
    return x, ids, w


def test_weights_within_eight_binades_of_their_block_are_exact():
    """Random MXFP4 weights: every group within 8 binades of its 128-column block's largest, so
    the e4m3 factors hold the dequantised weights exactly."""
    w = torch.randn(64, 256) * torch.logspace(-3, 0, 256)  # a column-varying magnitude
    packed, scale = mxfp4_quantize(w)
    s = scale.view(torch.uint8).int().view(64, 2, 4)
    assert (s.amax(-1, keepdim=True) - s).max() <= 8
    assert torch.equal(w4a8_weight(packed, scale), mxfp4_dequantize(packed, scale, torch.float32))


def test_a_group_far_below_its_block_rounds_to_e4m3():
    """Scale bytes 127 and 115 (12 binades apart) in one block: the small group's factor
    e2m1 * 2^-12 rounds to e4m3's subnormal grid (steps of 2^-9); the large group stays exact."""
    codes = torch.full((1, 64), 0x77, dtype=torch.uint8)  # e2m1 6.0 in every column
    codes[0, 16:32] = 0x33  # columns 32..63 (group 1): e2m1 1.5
    scale = torch.tensor([[127, 115, 127, 127]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    w = w4a8_weight(codes.view(torch.int8), scale)
    assert torch.all(w[0, :32] == 6.0) and torch.all(w[0, 64:] == 6.0)
    # 1.5 * 2^-12 = 0.75 * 2^-11 -> the nearest multiple of 2^-9 is 0 (ties to even: 0.375 ulp)
    assert torch.all(w[0, 32:64] == 0.0)
    assert w4a8_weight(codes.view(torch.int8), scale.view(torch.uint8).clamp(min=120).view(
        torch.float8_e8m0fnu))[0, 32:64].eq(1.5 * 2.0**-7).all()  # 7 binades: exact  # fmt: skip


def test_it_applies_above_the_gemv_sizes_only():
    assert not uses_w4a8(6 * 32, 256, FMT, "fp8")  # 32 tokens of V4-Flash: the GEMV
    assert uses_w4a8(6 * 33, 256, FMT, "fp8")
    assert not uses_w4a8(6144, 256, FMT, "bf16")
    assert not uses_w4a8(6144, 256, "mxfp4", "fp8")  # the stored layout: no W4A8 kernel
    with pytest.raises(AssertionError):
        uses_w4a8(6144, 256, FMT, "fp16")


@pytest.mark.parametrize("limit", [10.0, None])
def test_kernel_matches_its_reference(limit):
    weights = _halves(_weights(4, 256, 128, "mxfp4", seed=3))
    x, ids, w = _step(10, 256, 4, 2, seed=5)  # 20 pairs > 3 an expert: above the GEMV
    y = moe_experts(x, ids, w, *weights[:2], FMT, *weights[2:], limit, activations="fp8")
    ref = moe_experts_ref(x, ids, w, *weights[:2], FMT, *weights[2:], limit, activations="fp8")
    assert_moe_close(y, ref)
    exact = moe_experts_ref(x, ids, w, *weights[:2], FMT, *weights[2:], limit)
    rel = ((ref - exact).norm() / exact.norm()).item()
    assert 1e-3 < rel < 0.08, rel  # e4m3 x and h: a few percent of the layer's output


def test_expert_rows_with_skipped_pairs_and_a_pool_sized_expert_count():
    """The pool's call: skipped pairs (negative rows) keep their rows; `num_experts` (the
    model's E) decides the path, not the storage rows."""
    weights = _halves(_weights(3, 256, 128, "mxfp4", seed=7))
    x, ids, _ = _step(12, 256, 3, 2, seed=8)
    ids[0, 0] = ids[5, 1] = -1
    rows = torch.full((24, 256), 7.0, dtype=torch.bfloat16, device=DEVICE)
    out = expert_rows(x, ids, *weights[:2], FMT, *weights[2:], 10.0, rows=rows.clone(),
                      num_experts=4, skip=True, activations="fp8")  # fmt: skip
    ref = expert_rows_ref(x, ids, *weights[:2], FMT, *weights[2:], 10.0, rows=rows.clone(),
                          num_experts=4, skip=True, activations="fp8")  # fmt: skip
    assert torch.all(out[0] == 7.0) and torch.all(out[11] == 7.0)
    assert_moe_close(out.float(), ref.float())


def test_every_code_and_scale():
    """All 256 bytes under scale bytes 0 .. 128 through one-hot x columns: each gate / up output
    is one weight as `w4a8_weight` defines it (a block whose largest byte is 0 counts as 0)."""
    dim, inter = 128, 128
    weights = _halves(every_code_weights(dim, inter))
    ids = torch.zeros(8, 1, dtype=torch.int32, device=DEVICE)  # 8 pairs of one expert: the MMA
    ones = torch.ones(8, 1, device=DEVICE)
    x = torch.zeros(8, dim, device=DEVICE, dtype=torch.bfloat16)
    for i, col in enumerate((0, 1, 31, 32, 45, 64, 100, 127)):
        x[i, col] = 1.0
    y = moe_experts(x, ids, ones, *weights[:2], FMT, *weights[2:], None, activations="fp8")
    ref = moe_experts_ref(x, ids, ones, *weights[:2], FMT, *weights[2:], None, activations="fp8")
    assert_moe_close(y, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1024, 8192])
def test_production_shapes_and_graph_capture(num_tokens):
    weights = _halves(_weights(256, 4096, 2048, "mxfp4", seed=0))
    x, ids, w = _step(num_tokens, 4096, 256, 6, seed=1)
    args = (x, ids, w, *weights[:2], FMT, *weights[2:], 10.0)
    y = moe_experts(*args, activations="fp8")
    ref = moe_experts_ref(*args, activations="fp8")
    # not assert_moe_close's 98%-of-elements bound: where the kernel's and the reference's
    # fp32 sums round a gate / up value to different bf16 neighbours, h can land on the other
    # side of an e4m3 rounding and move its pair's outputs by one e4m3 step (H100: 97.5% of the
    # elements within the bf16 paths' bound at 1024 tokens)
    scale = ref.abs().amax().item()
    torch.testing.assert_close(y, ref, atol=2e-2 * scale, rtol=2e-2)
    assert ((y - ref).norm() / ref.norm()).item() < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts(*args, activations="fp8")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, y)
