"""The decode MXFP4 GEMV (kernels/moe_gemv.py) on the re-packed "mxfp4_halves128" layout
(kernels/moe_mxfp4.py) against moe_experts_ref, which unpacks the layout and dequantises: the
column map, every code under every scale, random steps, and which path each size takes.

Both sides multiply the same dequantised weights (the GEMV's bit upcast is exact); only the fp32
summation order differs.
"""

from __future__ import annotations

import functools

import pytest
import torch

from kernels import moe_gemv, moe_mxfp4
from kernels.moe import moe_experts, moe_experts_ref, served_path
from tests.kernels import moe_cases
from tests.kernels.moe_cases import DEVICE, assert_moe_close, check_step, every_code_weights
from tests.kernels.test_moe import _weights

FMT = "mxfp4_halves128"


def _halves(weights):
    w13, w2, s13, s2 = weights
    return moe_mxfp4.repack_halves(w13, 128), moe_mxfp4.repack_halves(w2, 128), s13, s2


@pytest.mark.parametrize("halves", [False, True])
def test_column_map_is_the_layout(halves):
    """Code c of word j (nibble c of the little-endian 32-bit word: lane c // 4, q = c % 4)
    holds column column_map[c, j], for every code of a 512-column row: rows r = 0..2 of a
    stored-layout tensor carry bits 4r..4r+3 of each column's index as its code."""
    k = 512
    cols = torch.arange(k)
    codes = torch.stack([(cols >> (4 * r)) & 15 for r in range(3)])  # [3, K]: the column index
    stored = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    packed = moe_mxfp4.repack_halves(stored, 128) if halves else stored
    words = packed.view(torch.int32).long() & 0xFFFFFFFF  # [3, K/8]
    nibbles = torch.stack([(words >> (4 * c)) & 15 for c in range(8)], dim=1)  # [3, 8, K/8]
    held = nibbles[0] | (nibbles[1] << 4) | (nibbles[2] << 8)  # [8, K/8]: column indices
    col = moe_gemv.column_map(k, halves)
    assert torch.equal(held, col)
    assert torch.equal(col.flatten().sort().values, cols)  # a permutation
    if halves:  # and the layout the MMA kernels and the reference read
        assert torch.equal(moe_mxfp4.unpack_halves(packed, 128), stored)


@pytest.mark.parametrize("halves", [False, True])
def test_permute_columns_follows_the_map(halves):
    x = torch.randn(3, 384).bfloat16()
    xp = moe_gemv.permute_columns(x, 4.0, halves)
    col = moe_gemv.column_map(384, halves)
    assert xp.shape == (3, 8, 48) and torch.equal(xp, x.float()[:, col] * 4.0)
    assert torch.equal(moe_gemv.unpermute_columns(xp, halves), x.float() * 4.0)


@pytest.mark.parametrize("post_scale", [False, True])
def test_every_code_and_scale(post_scale):
    """Every byte (all 16 x 16 low / high codes, at every position in a word) under UE8M0
    scales 2^-127 (subnormal weights), 2^-126, 2^-27, 1 and 2, through one-hot x columns in
    both halves of both 128-column blocks: each gate / up output is one dequantised weight."""
    dim, inter = 256, 128
    w13, w2, s13, s2 = _halves(every_code_weights(dim, inter))
    ids = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    one = torch.ones(1, 1, device=DEVICE)
    for col in (0, 1, 5, 31, 32, 63, 64, 71, 100, 127, 128, 190, 255):
        x = torch.zeros(1, dim, device=DEVICE, dtype=torch.bfloat16)
        x[0, col] = 1.0
        tune = {"GEMV": True, "POST_SCALE": post_scale}
        y = moe_experts(x, ids, one, w13, w2, FMT, s13, s2, None, tune=tune)
        assert_moe_close(y, moe_experts_ref(x, ids, one, w13, w2, FMT, s13, s2, None))


# each knob once under the interpreter (~12 s a case on 2 cores); the GPU test crosses them all
@pytest.mark.parametrize(("num_tokens", "block_m", "post_scale"),
                         [(1, 1, True), (1, 2, False), (3, 1, False), (3, 2, True)])  # fmt: skip
def test_gemv_halves_matches_ref(num_tokens, block_m, post_scale):
    """BLOCK_W 32 (256 columns a step): w13's 384 columns end in a masked half step."""
    weights = _halves(_weights(5, 384, 256, "mxfp4", seed=num_tokens))
    tune = {"GEMV": True, "BLOCK_M": block_m, "BLOCK_W": 32, "POST_SCALE": post_scale}
    check_step(weights, num_tokens, 384, 3, FMT, 10.0, seed=num_tokens, tune=tune)


def test_gemv_halves_no_limit_equals_stored_gemv():
    """Several tokens on one expert, no clamp: the halves GEMV against the reference and the
    stored-layout GEMV on the same weights (the same products, another summation order)."""
    weights = _weights(2, 256, 128, "mxfp4", seed=9)
    y = check_step(_halves(weights), 3, 256, 2, FMT, None, seed=9, tune={"GEMV": True})
    stored = check_step(weights, 3, 256, 2, "mxfp4", None, seed=9, tune={"GEMV": True})
    assert_moe_close(y, stored)


def test_served_path_by_size():
    """V4-Flash (E 256, top 6): the stored layout takes the GEMV up to 128 tokens, halves128
    up to 32 (its MMA kernel is faster from there), then the halves MMA kernel at every size
    (never the bf16 scratch the stored layout takes)."""
    for tokens, stored, halves in ((1, "gemv", "gemv"), (32, "gemv", "gemv"), (33, "gemv", "mma"),
                                   (128, "gemv", "mma"), (129, "mma", "mma"),
                                   (1024, "mma", "mma"), (8192, "dequant", "mma")):  # fmt: skip
        assert served_path(6 * tokens, 256, "mxfp4") == stored, tokens
        assert served_path(6 * tokens, 256, FMT) == halves, tokens
    assert served_path(6, 256, "mxfp4_halves64") == "mma"  # the GEMV reads K block 128 only
    assert moe_gemv.use_gemv(192, 256, FMT) and not moe_gemv.use_gemv(193, 256, FMT)


def test_halves_above_the_gemv_runs_the_mma_kernel():
    """Past GEMV_MAX_PAIRS_PER_EXPERT the untuned call takes the halves MMA kernel."""
    weights = _halves(_weights(2, 256, 128, "mxfp4", seed=4))
    assert served_path(8 * 2, 2, FMT) == "mma"
    check_step(weights, 8, 256, 2, FMT, 10.0, seed=4)


@functools.cache
def _production_weights(halves: bool):  # built once for the module's GPU tests (~3.4 GB each)
    stored = _weights(256, 4096, 2048, "mxfp4", seed=0)
    return _halves(stored) if halves else stored


@pytest.mark.gpu
@pytest.mark.parametrize("post_scale", [False, True])
@pytest.mark.parametrize("block_m", [1, 2])
@pytest.mark.parametrize("num_tokens", [1, 16, 64, 128])
def test_gemv_halves_production_shapes_gpu(num_tokens, block_m, post_scale):
    """V4-Flash: D 4096, I 2048, E 256, K 6; the halves GEMV against the reference and the
    stored-layout GEMV on the same experts."""
    stored = _production_weights(False)
    tune = {"GEMV": True, "BLOCK_M": block_m, "POST_SCALE": post_scale}
    y = check_step(_production_weights(True), num_tokens, 4096, 6, FMT, 10.0, seed=0, tune=tune)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(num_tokens, 4096, generator=g) * 2).bfloat16().to(DEVICE)
    ids, w = moe_cases.routing(num_tokens, 256, 6, 0)
    base = moe_experts(x, ids, w, *stored[:2], "mxfp4", *stored[2:], 10.0, tune=tune)
    assert_moe_close(y, base)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 32, 33, 1024, 8192])
def test_halves_served_paths_production_shapes_gpu(num_tokens):
    """The untuned halves128 call (GEMV, then the halves MMA kernel) at every served size."""
    check_step(_production_weights(True), num_tokens, 4096, 6, FMT, 10.0, seed=2)


@pytest.mark.gpu
def test_gemv_halves_cuda_graph_replay_gpu():
    weights = _halves(_weights(8, 256, 128, "mxfp4", seed=2))
    x = torch.randn(4, 256, device=DEVICE).bfloat16()
    ids, w = moe_cases.routing(4, 8, 2, 2)
    moe_cases.assert_graph_replay_equal(
        (x, ids, w, *weights[:2], FMT, *weights[2:], 10.0), {"GEMV": True}
    )
