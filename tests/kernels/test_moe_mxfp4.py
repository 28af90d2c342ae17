"""The MXFP4 MMA candidates (kernels/moe_mxfp4.py: tl.dot_scaled on the stored layout, and the
re-packed "halves" layouts with the bit upcast) against moe_experts_ref, the model's loop of
`swiglu` over dequantised experts. Both sides multiply the same dequantised weights in bf16;
only the fp32 summation order differs."""

from __future__ import annotations

import pytest
import torch

from kernels import moe_mxfp4
from kernels.moe import moe_experts, moe_experts_ref
from tests.kernels.moe_cases import DEVICE, assert_moe_close, check_step, every_code_weights
from tests.kernels.test_moe import _weights


def _halves(weights, block_k):
    w13, w2, s13, s2 = weights
    return moe_mxfp4.repack_halves(w13, block_k), moe_mxfp4.repack_halves(w2, block_k), s13, s2


@pytest.mark.parametrize("block_k", moe_mxfp4.HALVES_BLOCKS)
def test_repack_round_trip_and_layout(block_k):
    w = torch.randint(-128, 128, (2, 3, 128), dtype=torch.int8)
    r = moe_mxfp4.repack_halves(w, block_k)
    assert torch.equal(moe_mxfp4.unpack_halves(r, block_k), w)
    codes = torch.stack((w.view(torch.uint8) & 15, w.view(torch.uint8) >> 4), -1).flatten(-2)
    byte = r.view(torch.uint8)[1, 2, block_k // 2 + 5]  # second block, j = 5
    assert byte & 15 == codes[1, 2, block_k + 5] and byte >> 4 == codes[1, 2, 3 * block_k // 2 + 5]
    assert moe_mxfp4.halves_block(f"mxfp4_halves{block_k}") == block_k
    assert moe_mxfp4.halves_block("mxfp4") is None


@pytest.mark.parametrize("swap_ab", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 6])
def test_dot_scaled_matches_ref(num_tokens, swap_ab):
    weights = _weights(4, 160, 96, "mxfp4", seed=num_tokens)  # BLOCK_K 64: a masked K step
    tune = {"DOT_SCALED": True, "SWAP_AB": swap_ab}
    check_step(weights, num_tokens, 160, 2, "mxfp4", 10.0, seed=num_tokens, tune=tune)


@pytest.mark.parametrize("swap_ab", [True, False])
@pytest.mark.parametrize("block_k", moe_mxfp4.HALVES_BLOCKS)
def test_halves_match_ref(block_k, swap_ab):
    weights = _halves(_weights(4, 256, 128, "mxfp4", seed=block_k), block_k)
    fmt = f"mxfp4_halves{block_k}"
    check_step(weights, 5, 256, 2, fmt, 10.0, seed=block_k, tune={"SWAP_AB": swap_ab})


EVERY_CODE_PATHS = {"dot_scaled": ("mxfp4", {"DOT_SCALED": True}), "halves64": ("mxfp4_halves64", {}),
                    "halves64_bf16": ("mxfp4_halves64", {"HALVES_FP32": False}),
                    "halves64_fp32": ("mxfp4_halves64", {"HALVES_FP32": True})}  # fmt: skip


@pytest.mark.parametrize("path", ["dot_scaled", "halves64", "halves64_bf16"])
def test_every_code_and_scale(path):
    """Every byte under UE8M0 scales 2^-127 (subnormal weights) .. 2, through one-hot x
    columns: each gate / up output is one dequantised weight. On the GPU "halves64_bf16"
    upcasts the codes straight into bf16 bits (inline PTX) and "halves64_fp32" through fp32
    bits; the interpreter runs every halves path through fp32."""
    dim, inter = 128, 64
    weights = every_code_weights(dim, inter)
    fmt, tune = EVERY_CODE_PATHS[path]
    if fmt != "mxfp4":
        weights = _halves(weights, 64)
    ids = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    one = torch.ones(1, 1, device=DEVICE)
    for col in (0, 1, 31, 32, 45, 127):
        x = torch.zeros(1, dim, device=DEVICE, dtype=torch.bfloat16)
        x[0, col] = 1.0
        y = moe_experts(x, ids, one, *weights[:2], fmt, *weights[2:], None, tune=tune)
        assert_moe_close(y, moe_experts_ref(x, ids, one, *weights[:2], fmt, *weights[2:], None))


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["halves64_bf16", "halves64_fp32"])
def test_every_code_and_scale_on_the_gpu(path):
    """The bf16-bit upcast's inline PTX (and its fp32 baseline) on the card: every byte and
    scale, subnormal weights and the largest scale the layout holds (128) included."""
    test_every_code_and_scale(path)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 1024])
def test_candidates_at_production_shapes(num_tokens):
    weights = _weights(256, 4096, 2048, "mxfp4", seed=0)
    check_step(weights, num_tokens, 4096, 6, "mxfp4", 10.0, seed=1, tune={"DOT_SCALED": True})
    for block_k in moe_mxfp4.HALVES_BLOCKS:
        for fp32 in (False, True):  # the upcast to bf16 bits and through fp32 bits
            check_step(_halves(weights, block_k), num_tokens, 4096, 6, f"mxfp4_halves{block_k}",
                       10.0, seed=1, tune={"HALVES_FP32": fp32})  # fmt: skip
