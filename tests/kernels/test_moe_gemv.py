"""The decode MXFP4 MoE GEMV (kernels/moe_gemv.py) against moe_experts_ref (the model's loop of
`swiglu` over dequantised experts) and against the in-register MMA kernel it replaces.

Both sides multiply the same dequantised weights (the GEMV's bit upcast is exact) and round the
GEMM outputs to bf16 where the reference does; only the fp32 summation order differs.
"""

from __future__ import annotations

import functools

import pytest
import torch

from dsv4.ops.quant import mxfp4_quantize
from kernels import moe_gemv
from kernels.moe import moe_experts, moe_experts_ref
from tests.kernels.moe_cases import (
    DEVICE,
    assert_graph_replay_equal,
    assert_moe_close,
    check_step,
    every_code_weights,
    routing,
)
from tests.kernels.test_moe import _weights


def test_permute_columns_round_trip():
    x = torch.randn(3, 64, device=DEVICE).bfloat16()
    xp = moe_gemv.permute_columns(x)
    assert xp.shape == (3, 8, 8) and xp[1, 5, 2] == x[1, 8 * 2 + 5]
    assert torch.equal(moe_gemv.unpermute_columns(xp), x.float())


@pytest.mark.parametrize("post_scale", [False, True])
def test_every_code_and_scale(post_scale):
    """Every byte (all 16 x 16 low/high e2m1 codes, at every position in a word) under UE8M0
    scales 2^-127 (subnormal weights), 2^-126, 2^-27, 1 and 2, through one-hot x columns: each
    gate / up output is one dequantised weight."""
    dim, inter = 64, 32
    w13, w2, s13, s2 = every_code_weights(dim, inter)
    ids = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    one = torch.ones(1, 1, device=DEVICE)
    for col in (0, 1, 7, 8, 13, 63):
        x = torch.zeros(1, dim, device=DEVICE, dtype=torch.bfloat16)
        x[0, col] = 1.0
        tune = {"GEMV": True, "POST_SCALE": post_scale}
        y = moe_experts(x, ids, one, w13, w2, "mxfp4", s13, s2, None, tune=tune)
        assert_moe_close(y, moe_experts_ref(x, ids, one, w13, w2, "mxfp4", s13, s2, None))


@pytest.mark.parametrize("post_scale", [False, True])
@pytest.mark.parametrize("block_m", [1, 2])
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_gemv_matches_ref(num_tokens, block_m, post_scale):
    weights = _weights(5, 160, 96, "mxfp4", seed=num_tokens)  # 20 / 12 words a row: masked
    tune = {"GEMV": True, "BLOCK_M": block_m, "POST_SCALE": post_scale}
    check_step(weights, num_tokens, 160, 3, "mxfp4", 10.0, seed=num_tokens, tune=tune)


def test_gemv_no_limit_and_two_rows_an_expert():
    """Several tokens on one expert (BLOCK_M 2: a full tile and a padded one), no clamp."""
    weights = _weights(2, 64, 32, "mxfp4", seed=9)
    check_step(weights, 3, 64, 2, "mxfp4", None, seed=9, tune={"GEMV": True, "BLOCK_M": 2})


def test_served_choice():
    assert moe_gemv.use_gemv(6, 256, "mxfp4") and moe_gemv.use_gemv(768, 256, "mxfp4")  # 128 tok
    assert not moe_gemv.use_gemv(1536, 256, "mxfp4") and not moe_gemv.use_gemv(6, 256, "fp8")


@functools.cache
def _production_weights():  # built once for the module's GPU tests (~3.4 GB)
    return _weights(256, 4096, 2048, "mxfp4", seed=0)


@pytest.mark.gpu
@pytest.mark.parametrize("post_scale", [False, True])
@pytest.mark.parametrize("block_m", [1, 2])
@pytest.mark.parametrize("num_tokens", [1, 16, 64])
def test_gemv_production_shapes_gpu(num_tokens, block_m, post_scale):
    """V4-Flash: D 4096, I 2048, E 256, K 6; against the reference and the in-register kernel."""
    weights = _production_weights()
    y = check_step(weights, num_tokens, 4096, 6, "mxfp4", 10.0, seed=0,
                   tune={"GEMV": True, "BLOCK_M": block_m, "POST_SCALE": post_scale})  # fmt: skip
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(num_tokens, 4096, generator=g) * 2).bfloat16().to(DEVICE)
    ids, w = routing(num_tokens, 256, 6, 0)
    mma = moe_experts(x, ids, w, *weights[:2], "mxfp4", *weights[2:], 10.0, tune={"GEMV": False})
    assert_moe_close(y, mma)


@pytest.mark.gpu
def test_gemv_cuda_graph_replay_gpu():
    weights = _weights(8, 256, 128, "mxfp4", seed=2)
    x = torch.randn(4, 256, device=DEVICE).bfloat16()
    ids, w = routing(4, 8, 2, 2)
    assert_graph_replay_equal(
        (x, ids, w, *weights[:2], "mxfp4", *weights[2:], 10.0), {"GEMV": True}
    )


def test_quantised_weights_round_trip():  # the test's weights are the quantiser's own format
    w = torch.randn(8, 64)
    q, s = mxfp4_quantize(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float8_e8m0fnu
