"""kernels/moe_dequant.py: the experts' dequantise kernel against the torch dequantisers
(bit-exact), moe_experts_dequant against moe_experts_ref (the tolerances of test_moe.py) and,
on a GPU, against moe_experts' in-register path; the dispatch rule; the benchmark's dry run.
"""

from __future__ import annotations

import pytest
import torch

import kernels.moe_dequant as moe_dequant
from dsv4.ops.quant import fp8_block_quantize, mxfp4_quantize
from kernels.moe import expert_rows, moe_experts, moe_experts_dequant
from kernels.moe_dequant import (
    DEQUANT_MIN_PAIRS_PER_EXPERT,
    dequantize_experts,
    dequantize_experts_ref,
    use_dequant,
)
from tests.kernels.bench_dry_run import dry_run_records
from tests.kernels.moe_cases import DEVICE, assert_moe_close, check_step, routing


def _quantized(num_experts, rows, cols, fmt, seed, fp32_scale=False):
    """[E, rows, cols] random weights in `fmt` -> (codes, scales) stacked over experts."""
    g = torch.Generator(DEVICE).manual_seed(seed)
    w = torch.randn(num_experts, rows, cols, generator=g, device=DEVICE) / cols**0.5
    quant = fp8_block_quantize if fmt == "fp8" else mxfp4_quantize
    codes, scales = (torch.stack(t) for t in zip(*(quant(we) for we in w)))
    if fp32_scale:  # not powers of two: the bf16 rounding of the product is exercised
        scales = scales.float() * (1.0 + torch.rand(scales.shape, generator=g, device=DEVICE))
    return codes, scales


def _experts(num_experts, dim, inter, fmt, seed):
    w13, s13 = _quantized(num_experts, 2 * inter, dim, fmt, seed)
    w2, s2 = _quantized(num_experts, dim, inter, fmt, seed + 1)
    return w13, w2, s13, s2


@pytest.mark.parametrize(
    "fmt,fp32_scale,rows,cols,e0,e1",
    [
        ("fp8", False, 200, 136, 1, 3),  # partial 128-blocks on both sides, a sub-range
        ("fp8", True, 200, 136, 0, 3),
        ("fp8", False, 32, 128, 2, 2),  # an empty range
        ("mxfp4", False, 40, 96, 1, 2),  # 3 scale groups a row: a partial column tile
        ("mxfp4", False, 64, 256, 0, 3),
    ],
)
def test_dequantize_experts_matches_ref(fmt, fp32_scale, rows, cols, e0, e1):
    w, s = _quantized(3, rows, cols, fmt, seed=rows + cols, fp32_scale=fp32_scale)
    out = dequantize_experts(w, s, fmt, e0, e1)
    ref = dequantize_experts_ref(w, s, fmt, e0, e1)
    assert out.dtype == torch.bfloat16 and out.shape == (e1 - e0, rows, cols)
    assert torch.equal(out, ref)


def test_dequantize_experts_into_scratch_uint8():
    """uint8 packing, written into the head of a larger scratch; the rest is left alone."""
    w, s = _quantized(4, 48, 64, "mxfp4", seed=9)
    scratch = torch.full((3, 48, 64), 7.0, dtype=torch.bfloat16, device=DEVICE)
    out = dequantize_experts(w.view(torch.uint8), s, "mxfp4", 2, 4, out=scratch)
    assert out.data_ptr() == scratch.data_ptr() and out.shape == (2, 48, 64)
    assert torch.equal(scratch[:2], dequantize_experts_ref(w, s, "mxfp4", 2, 4))
    assert (scratch[2] == 7.0).all()


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_dequantize_experts_of_an_id_list_matches_ref(fmt):
    """`ids`: the listed experts in the listed order (a sub-range of the list)."""
    w, s = _quantized(5, 40, 128, fmt, seed=3)
    ids = torch.tensor([4, 0, 3], dtype=torch.int32, device=DEVICE)
    out = dequantize_experts(w, s, fmt, 1, 3, ids=ids)
    assert torch.equal(out, dequantize_experts_ref(w, s, fmt, 1, 3, ids=ids))
    assert torch.equal(out, torch.stack([dequantize_experts_ref(w, s, fmt, e, e + 1)[0]
                                         for e in (0, 3)]))  # fmt: skip


def test_scratch_path_with_used_rows_dequantises_only_those(monkeypatch):
    """An expert pool's round (skip, a few storage rows named): the scratch path dequantises
    only `used_rows`, chunk by chunk of them, and writes the same bits as when it dequantises
    every row; skipped pairs keep their rows."""
    dim, inter, num_rows, k = 64, 32, 7, 2
    w13, w2, s13, s2 = _experts(num_rows, dim, inter, "mxfp4", seed=21)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(12, dim, generator=g).bfloat16().to(DEVICE)
    ids, _ = routing(12, num_rows, k, seed=6)
    used = [5, 1, 2]  # this round's storage rows; the others' pairs are skipped (-1)
    ids = torch.where(torch.isin(ids, torch.tensor(used, device=DEVICE, dtype=ids.dtype)), ids, -1)
    assert (ids >= 0).any() and (ids < 0).any()
    seen = []
    real = moe_dequant.dequantize_experts

    def counting(w, scale, format, e0=0, e1=None, out=None, ids=None):
        seen.append((e1 - e0, ids is not None))
        return real(w, scale, format, e0, e1, out, ids)

    monkeypatch.setattr(moe_dequant, "dequantize_experts", counting)
    outs = []
    for used_rows in (None, torch.tensor(used, dtype=torch.int32, device=DEVICE)):
        rows = torch.full((ids.numel(), dim), 3.0, dtype=torch.bfloat16, device=DEVICE)
        outs.append(
            expert_rows(
                x,
                ids,
                w13,
                w2,
                "mxfp4",
                s13,
                s2,
                10.0,
                rows=rows,
                skip=True,
                used_rows=used_rows,
                tune={"DEQUANT": True, "CHUNK_EXPERTS": 2},
            )
        )
    assert torch.equal(outs[0], outs[1])
    assert (outs[1][ids.flatten() < 0] == 3.0).all()
    # all 7 rows in chunks of 2 (w13 and w2 each), then the 3 named rows in chunks of 2, 1
    assert seen == [(2, False)] * 6 + [(1, False)] * 2 + [(2, True)] * 2 + [(1, True)] * 2


def _check(num_tokens, dim, inter, num_experts, k, fmt, limit, chunk, seed=0):
    """The scratch path (chunks of `chunk` experts) against the reference."""
    weights = _experts(num_experts, dim, inter, fmt, seed)
    tune = {"DEQUANT": True, "CHUNK_EXPERTS": chunk}
    return check_step(weights, num_tokens, dim, k, fmt, limit, seed, tune)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("limit", [10.0, 0.5, None])
def test_moe_experts_dequant_matches_ref(fmt, limit):
    # 2 tokens x 2 slots over 6 experts: at least two experts get none; chunks [0, 4), [4, 6)
    _check(2, 64, 32, 6, 2, fmt, limit, chunk=4, seed=len(fmt) + int(limit or 0))


@pytest.mark.parametrize("fmt,inter", [("fp8", 48), ("mxfp4", 64)])  # MXFP4: I % 32 == 0
def test_moe_experts_dequant_chunks_do_not_change_outputs(fmt, inter):
    """One expert a chunk (5 chunks) and all at once give the same bits: a tile reads only its
    own expert, whichever chunk it is computed in. Odd D, E, K."""
    one = _check(3, 96, inter, 5, 3, fmt, 10.0, chunk=1, seed=5)
    all_at_once = _check(3, 96, inter, 5, 3, fmt, 10.0, chunk=None, seed=5)
    assert torch.equal(one, all_at_once)


def test_moe_experts_dequant_no_tokens():
    _check(0, 64, 32, 4, 2, "fp8", 10.0, chunk=2)


def test_use_dequant_rule():
    n = DEQUANT_MIN_PAIRS_PER_EXPERT * 256
    assert use_dequant(n, 256, "mxfp4", True)
    assert not use_dequant(10**6, 256, "fp8", True)  # FP8 in registers won at every size
    assert not use_dequant(n - 1, 256, "mxfp4", True)
    assert not use_dequant(10**6, 256, "bf16", True)
    assert use_dequant(n, 256, "mxfp4", False) == use_dequant(n, 256, "mxfp4", True)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("num_tokens", [64, 2048])
def test_moe_experts_dequant_vs_in_register_gpu(fmt, num_tokens):
    """V4-Flash (D 4096, I 2048, E 256, K 6), 4 chunks of 64 experts: the same values as
    moe_experts dequantising in registers, up to summation order."""
    w13, w2, s13, s2 = _experts(256, 4096, 2048, fmt, seed=0)
    x = (torch.randn(num_tokens, 4096, device=DEVICE) * 2).bfloat16()
    ids, w = routing(num_tokens, 256, 6, seed=1)
    y = moe_experts_dequant(x, ids, w, w13, w2, fmt, s13, s2, 10.0, chunk_experts=64)
    base = moe_experts(x, ids, w, w13, w2, fmt, s13, s2, 10.0, tune={"DEQUANT": False})
    assert_moe_close(y, base)


def test_benchmark_dry_run(tmp_path):
    """benchmarks/bench_kernels_moe_dequant.py --dry-run (CPU, tiny shapes, references) writes its
    records."""
    records = dry_run_records(tmp_path, "bench_kernels_moe_dequant")
    assert {r["name"] for r in records} == {"moe_experts_dequant", "moe_experts_dequant_bf16"}
