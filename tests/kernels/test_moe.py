"""moe_experts (kernels/moe.py) against moe_experts_ref (the model's loop of `swiglu` over
experts) for bf16, FP8 block-scaled and MXFP4 weights, plus the routing-metadata invariants.

Both sides compute on the same dequantised weights; the kernel rounds its GEMM outputs to bf16
where the reference does, so the difference is summation order (and the interpreter's bf16
truncation at the final store does not apply: outputs are fp32).
"""

from __future__ import annotations

import pytest
import torch

from dsv4.ops.quant import fp8_block_quantize, mxfp4_quantize
from kernels.moe import (
    combine_rows,
    combine_rows_ref,
    expert_rows,
    expert_rows_ref,
    moe_align,
    moe_experts,
    moe_experts_ref,
    shared_expert,
)
from tests.kernels.bench_dry_run import dry_run_records
from tests.kernels.moe_cases import DEVICE, check_step, routing


def _weights(num_experts, dim, inter, fmt, seed):
    g = torch.Generator(DEVICE).manual_seed(seed)  # on the device: production sizes are large
    w13 = torch.randn(num_experts, 2 * inter, dim, generator=g, device=DEVICE) / dim**0.5
    w2 = torch.randn(num_experts, dim, inter, generator=g, device=DEVICE) / inter**0.5
    if fmt == "bf16":
        return w13.bfloat16(), w2.bfloat16(), None, None
    quant = fp8_block_quantize if fmt == "fp8" else mxfp4_quantize
    q13, s13 = zip(*(quant(w) for w in w13))
    q2, s2 = zip(*(quant(w) for w in w2))
    return tuple(torch.stack(t) for t in (q13, q2, s13, s2))


def _check(num_tokens, dim, inter, num_experts, k, fmt, limit, seed=0, tune=None):
    weights = _weights(num_experts, dim, inter, fmt, seed)
    check_step(weights, num_tokens, dim, k, fmt, limit, seed, tune)


@pytest.mark.parametrize("num_tokens", [0, 1, 5])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_moe_experts_matches_ref(num_tokens, fmt):
    _check(num_tokens, 64, 32, 4, 2, fmt, limit=10.0)
    if fmt == "mxfp4":  # served through kernels/moe_gemv.py at these sizes: the MMA kernel too
        _check(num_tokens, 64, 32, 4, 2, fmt, limit=10.0, tune={"GEMV": False})


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("tune", [None, {"GEMV": False}])
def test_skipped_pairs_add_nothing(fmt, tune):
    """`skip`: pairs with id -1 (an expert-parallel rank's pairs of other ranks' experts) add
    exactly nothing, whatever their weight, and the rest equals the call without them."""
    if tune and fmt != "mxfp4":
        pytest.skip("the GEMV path is MXFP4's")
    w13, w2, s13, s2 = _weights(4, 64, 32, fmt, seed=7)
    g = torch.Generator(DEVICE).manual_seed(8)
    x = torch.randn(6, 64, generator=g, device=DEVICE).bfloat16()
    ids = torch.randint(0, 4, (6, 3), generator=g, device=DEVICE, dtype=torch.int32)
    weights = torch.rand(6, 3, generator=g, device=DEVICE)
    dropped = torch.rand(6, 3, generator=g, device=DEVICE) < 0.5
    dropped[0] = True  # a token with every pair skipped
    kept_w = torch.where(dropped, torch.zeros_like(weights), weights)
    skipped = torch.where(dropped, torch.full_like(ids, -1), ids)
    args = (w13, w2, fmt, s13, s2, 10.0)
    got = moe_experts(x, skipped, weights, *args, skip=True, tune=tune)  # weights NOT zeroed
    want = moe_experts(x, ids, kept_w, *args, tune=tune)
    ref = moe_experts_ref(x, skipped, kept_w, *args, skip=True)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


def test_moe_experts_clamp_and_no_limit():
    _check(5, 64, 32, 4, 2, "bf16", limit=0.5, seed=3)  # the clamp is active on most values
    _check(5, 64, 32, 4, 2, "bf16", limit=None, seed=4)


def test_moe_experts_odd_sizes():
    _check(3, 96, 48, 5, 3, "bf16", limit=10.0, seed=5)  # non-power-of-two D, I, E, K


# config overrides: the swapped-operand tile (W_tile @ x^T) at the interpreter's tile and at
# other row / column / K tiles, and the default orientation at the last; BLOCK_K 64 leaves a
# partial K step (half an MXFP4 step's scale groups masked) at D = 160
TUNES = ({"SWAP_AB": True}, {"SWAP_AB": True, "BLOCK_M": 32, "BLOCK_N": 16},
         {"SWAP_AB": True, "BLOCK_N": 32, "BLOCK_K": 64}, {"BLOCK_N": 32, "BLOCK_K": 64})  # fmt: skip


@pytest.mark.parametrize("tune", TUNES, ids=("swap", "swap,m32,n16", "swap,n32,k64", "n32,k64"))
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_moe_experts_tunes_match_ref(fmt, tune):
    _check(5, 64, 32, 4, 2, fmt, limit=10.0, seed=7, tune=tune)
    dim, inter = (160, 96) if fmt == "mxfp4" else (100, 40)  # MXFP4 needs multiples of 32
    _check(3, dim, inter, 5, 3, fmt, limit=10.0, seed=8, tune=tune)  # odd D, I, E, K


def _pooled(weights, perm, extra):
    """The experts' storage as an expert pool holds it: logical expert e in row perm[e], plus
    `extra` rows of noise (empty cache slots)."""
    out = []
    for t in weights:
        if t is None:
            out.append(None)
            continue
        rows = torch.zeros(t.shape[0] + extra, *t.shape[1:], dtype=t.dtype, device=t.device)
        rows.view(torch.uint8)[perm.to(t.device)] = t.view(torch.uint8)
        out.append(rows)
    return out


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("num_tokens", [3, 40])
def test_expert_rows_on_pool_rows_equal_the_resident_call_bit_for_bit(fmt, num_tokens):
    """`expert_rows` on storage rows (with num_experts = the logical E, in one call or in two
    skip rounds) then `combine_rows` equals `moe_experts` on the logical ids; the references
    likewise equal `moe_experts_ref`."""
    num_experts, k = 6, 2
    weights = _weights(num_experts, 64, 32, fmt, seed=7)
    perm = torch.tensor([3, 0, 7, 5, 1, 6])  # logical e -> its pool row (rows 2, 4: empty)
    pooled = _pooled(weights, perm, extra=2)
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(num_tokens, 64, generator=g) * 2).bfloat16().to(DEVICE)
    ids, w = routing(num_tokens, num_experts, k, seed=9)
    rows_of = perm.to(DEVICE)[ids.long()].to(torch.int32)
    expect = moe_experts(x, ids, w, *weights[:2], fmt, *weights[2:], 10.0)
    rows = expert_rows(x, rows_of, *pooled[:2], fmt, *pooled[2:], 10.0, num_experts=num_experts)
    assert torch.equal(combine_rows(rows, w, ids), expect)
    first = ids < 3  # two rounds: experts 0-2, then 3-5, into one buffer
    rounds = None
    for part in (first, ~first):
        rounds = expert_rows(x, torch.where(part, rows_of, -1), *pooled[:2], fmt, *pooled[2:],
                             10.0, rows=rounds, num_experts=num_experts, skip=True)  # fmt: skip
    assert torch.equal(combine_rows(rounds, w, ids), expect)
    expect_ref = moe_experts_ref(x, ids, w, *weights[:2], fmt, *weights[2:], 10.0)
    rows_ref = None
    for part in (first, ~first):
        rows_ref = expert_rows_ref(x, torch.where(part, rows_of, -1), *pooled[:2], fmt,
                                   *pooled[2:], 10.0, rows=rows_ref, skip=True)  # fmt: skip
    assert torch.equal(combine_rows_ref(rows_ref, w, ids), expect_ref)


def test_shared_expert_is_one_expert():
    w13, w2, _, _ = _weights(1, 64, 32, "bf16", 6)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(6)).bfloat16().to(DEVICE)
    ones = torch.ones(5, 1, device=DEVICE)
    ref = moe_experts_ref(x, torch.zeros(5, 1, dtype=torch.int32, device=DEVICE), ones, w13, w2)
    torch.testing.assert_close(shared_expert(x, w13[0], w2[0]), ref, atol=2e-2, rtol=2e-2)


def _shared_case(num_tokens, dim, inter, num_experts, k, fmt, seed, skip=False):
    """(moe_experts' args, a shared expert's output [T, D] bf16): elements far larger than the
    routed sum (the rounding is theirs), far smaller, zeros, bf16's largest magnitudes."""
    weights = _weights(num_experts, dim, inter, fmt, seed)
    g = torch.Generator().manual_seed(seed + 2)
    x = (torch.randn(num_tokens, dim, generator=g) * 2).bfloat16().to(DEVICE)
    ids, w = routing(num_tokens, num_experts, k, seed)
    if skip:  # an expert-parallel rank's pairs of other ranks' experts
        ids = torch.where(ids % 2 == 0, ids, -1)
    s = torch.randn(num_tokens, dim, generator=g) * torch.tensor([1.0, 1e-3, 300.0, 0.0]).repeat(
        dim // 4)  # fmt: skip
    if num_tokens:  # bf16's largest finite value: + a positive sum, rounds up to inf or down
        s[0, :2] = torch.tensor([3.3895e38, -3.3895e38])
    args = (x, ids, w, weights[0], weights[1], fmt, weights[2], weights[3], 10.0)
    return args, s.bfloat16().to(DEVICE)


@pytest.mark.parametrize("num_tokens", [0, 1, 5])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("skip", [False, True])
def test_shared_joins_the_combine_bit_for_bit(num_tokens, fmt, skip):
    """`shared`: the combine adds it after the routed sum and rounds to bf16 in its own launch,
    the bits of `y += shared; y.to(bf16)` (what the paged forward did in two more launches);
    the reference likewise over its own sum."""
    args, s = _shared_case(num_tokens, 64, 32, 4, 2, fmt, 7, skip)
    for op in (moe_experts, moe_experts_ref):
        y = op(*args, skip=skip)
        y += s
        fused = op(*args, skip=skip, shared=s)
        assert fused.dtype == torch.bfloat16 and torch.equal(fused, y.to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_shared_joins_the_combine_production_shapes_gpu(fmt, num_tokens):
    """V4-Flash decode: D 4096, I 2048, E 256, K 6; the fused combine's bits on the GPU."""
    args, s = _shared_case(num_tokens, 4096, 2048, 256, 6, fmt, 8)
    y = moe_experts(*args)
    y += s
    assert torch.equal(moe_experts(*args, shared=s), y.to(torch.bfloat16))


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_moe_align_invariants(block_m):
    ids, _ = routing(7, 5, 3, 8)
    sorted_ids, tile_e = moe_align(ids, 5, block_m)
    n = ids.numel()
    assert sorted_ids.numel() == tile_e.numel() * block_m
    valid = sorted_ids[sorted_ids < n].long()
    assert sorted(valid.tolist()) == list(range(n))  # every pair exactly once
    flat = ids.reshape(-1).long()
    for t, e in enumerate(tile_e.tolist()):
        block = sorted_ids[t * block_m : (t + 1) * block_m].long()
        block = block[block < n]
        if e < 0:
            assert block.numel() == 0
        else:  # a tile holds one expert's pairs only
            assert (flat[block] == e).all()


@pytest.mark.gpu
@pytest.mark.parametrize("swap_ab", [False, True])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("num_tokens", [1, 64, 8192])
def test_moe_experts_production_shapes_gpu(fmt, num_tokens, swap_ab):
    """V4-Flash: D 4096, I 2048, E 256, K 6."""
    _check(num_tokens, 4096, 2048, 256, 6, fmt, limit=10.0, tune={"SWAP_AB": swap_ab})


def test_benchmark_dry_run(tmp_path):
    """`python -m benchmarks.bench_kernels_moe --dry-run` (CPU, tiny shapes, refs): its records."""
    records = dry_run_records(tmp_path, "bench_kernels_moe")
    names = {"moe_experts", "moe_tile", "moe_align", "compressor_step", "sample"}
    assert {r["name"] for r in records} == names
