"""Routed MoE experts as two grouped GEMMs over expert-sorted rows (docs/model.md#moe).

For every (token t, slot k) pair routed to expert e = expert_ids[t, k] with weight w[t, k]:
    g, a = bf16(W1_e x_t), bf16(W3_e x_t);  g <- min(g, limit);  a <- clamp(a, -limit, limit)
    h = bf16(silu(g) * a);  y_t += w[t, k] * bf16(W2_e h)          (fp32 accumulation)
which is `dsv4.ops.moe.swiglu` per expert, with its roundings (`moe_experts_ref` is that loop).

Steps, all without a host sync (CUDA-graph capturable):
1. `moe_align` (kernels/moe_align.py: one launch up to 2048 pairs, torch ops above): the T*K
   pairs sorted by expert, each expert's run padded to a multiple of BLOCK_M (pad = the sentinel
   T*K), and the expert of every BLOCK_M-row tile (-1 for the unused tail tiles of the static
   upper bound floor(T*K / BLOCK_M) + min(T*K, E)).
2. `_w13_kernel` (kernels/moe_gemm.py, as step 3): per (row tile, BLOCK_N columns of I) the gate and up GEMMs share the gathered
   x tile; SwiGLU with the clamp in the epilogue; h [rows, I] bf16 in sorted order.
3. `_w2_kernel`: per (row tile, BLOCK_N columns of D) h @ W2_e^T, stored bf16 to the pair's row
   t*K + k of a [T*K, D] buffer.
4. `_moe_combine_kernel`: y_t = sum_k w[t, k] * row[t*K + k] in fp32, in k order: deterministic (no
   atomics), so a token's output does not depend on the batch.
The routing weight is applied in fp32 after W2 (as the model does) rather than folded into h
before W2, which would round w*h to bf16; the cost is the combine pass (~2% at 8192 tokens).

Weight formats, dequantised in registers right after the load (the MMA runs in bf16, exactly
on the dequantised values, as the reference's dequantise-then-GEMM):
- "bf16": w13 [E, 2I, D] (rows [0, I) = W1 gate, [I, 2I) = W3 up), w2 [E, D, I];
- "fp8": the same shapes in float8_e4m3fn, scales [E, ceil(rows/128), ceil(cols/128)] (UE8M0 or
  fp32) per 128x128 block; BLOCK_K divides 128 so a K step sits in one scale block;
- "mxfp4": int8 [E, rows, cols/2] packed e2m1 pairs (low nibble = even column), UE8M0 scales
  [E, rows, cols/32]. The even and odd columns of the x tile are loaded separately and meet the
  low and high nibbles in two half-K dots, so no nibble interleave is needed.
- "mxfp4_halves64" / "mxfp4_halves128": the same codes re-packed per K block (kernels/
  moe_mxfp4.py; the paged forward serves "mxfp4_halves128" under features.mxfp4_layout=halves128,
  the served default since its H100 timing; the stored layout stays the A/B baseline).
Decode-sized MXFP4 steps (<= moe_gemv.GEMV_MAX_PAIRS_PER_EXPERT pairs an expert, 128 tokens of
V4-Flash, stored; HALVES_GEMV_MAX_PAIRS_PER_EXPERT, 32 tokens, halves128) run as a batched
CUDA-core GEMV instead (kernels/moe_gemv.py:
1.6x bf16 experts at 1-16 tokens on the H200, 3.1x this kernel at one token); tune GEMV=False
keeps this kernel. Prefill-sized stored MXFP4 steps (>= DEQUANT_MIN_PAIRS_PER_EXPERT pairs an
expert) instead dequantise the experts chunk by chunk into a bf16 scratch and run these GEMMs in
bf16 (kernels/moe_dequant.py): on the H200 3x faster at 8192 tokens than the per-element nibble
decode. The halves layouts take this module's kernel (FMT 4) above the GEMV at every size (H100:
1.44x the scratch path at 8192 tokens). `served_path` says which path a size takes.
`activations="fp8"` (`features.moe_activations`, W4A8: kernels/moe_w4a8.py) replaces that halves
kernel for "mxfp4_halves128" experts with e4m3 x and h on the FP8 MMA (`uses_w4a8`); its numerics
are its own (dsv4/ops/w4a8.py), so the references take the same argument.

Shared expert: fused only behind `features.fuse_shared_expert` (bf16 experts, decode-sized
steps: the paged forward routes every token to slot E of the stacked storage). In checkpoints it
is FP8 while the routed experts are MXFP4 (one launch takes one format), at 8192 tokens it is a
dense GEMM at full tile occupancy on its own, and on the H200 the fusion paid 1.06x at batch 1
only while rounding unlike cuBLAS (docs/BENCHMARKS.md), so it is off by default. Call
`moe_experts` with expert_ids = 0 and one expert's weights for it alone (`shared_expert`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops.moe import swiglu
from dsv4.ops.w4a8 import w4a8_swiglu, w4a8_weight
from kernels import moe_gemv, moe_mxfp4, moe_w4a8
from kernels.jit_helpers import bf16_rne
from kernels.moe_align import moe_align, moe_align_ref
from kernels.moe_dequant import gemms_through_scratch, use_dequant
from kernels.moe_gemm import (
    FMT_DOT_SCALED,
    FMT_HALVES,
    FMT_HALVES_FP32,
    FORMATS,
    dequantize_expert,
    grouped_gemms,
)
from kernels.registry import register_op
from kernels.specialize import sizes_vary

# SWAP_AB: compute each tile transposed, W_tile @ a^T, so the weight dequantised in registers is
# the MMA's A operand (Hopper's wgmma reads B from shared memory only) and a decode step's few
# rows per expert sit on the MMA's N side. `_config` turns it on for quantised experts at
# decode sizes (BLOCK_M 16), where the H200 sweep (--only moe_tile) measured it faster.
SWAP_AB_DEFAULT = False
# MXFP4 at decode sizes through kernels/moe_gemv.py (moe_gemv.use_gemv); False: the in-register
# MMA kernel below at every size (tune GEMV overrides either way).
GEMV_DEFAULT = True
# The halves MMA kernel's upcast on the GPU (kernels/moe_mxfp4.py): straight into bf16 bits
# with inline PTX (False, served: 0.31 warp instructions a weight byte against 0.48 compiled for
# sm_90; on an H100, the same outputs and 1.18x at 1024 tokens, 1.10x at 8192, 1.20-1.22x at
# 16-64: benchmarks/results/moe-mxfp4-bf16-upcast-h100.json) or through fp32 bits (True, the
# baseline); tune HALVES_FP32 picks either.
HALVES_FP32_DEFAULT = False
# a tune of the MMA kernel: no GEMV
_MMA_KEYS = {"SWAP_AB", "BLOCK_K", "GROUP_M", "num_stages", "DOT_SCALED", "HALVES_FP32"}


@triton.jit(**sizes_vary("T"))
def _moe_combine_kernel(rows_ptr, w_ptr, s_ptr, y_ptr, T, D, TOPK: tl.constexpr,
                        SHARED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """y[t] = sum_k w[t, k] * rows[t*K + k] in fp32, k ascending; with SHARED + s[t] in fp32,
    then stored as bf16 (y's dtype: the shared expert's)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mk = (t < T)[:, None] & (d < D)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for k in tl.static_range(TOPK):
        pair = t.to(tl.int64) * TOPK + k
        w = tl.load(w_ptr + pair, mask=t < T, other=0.0)
        r = tl.load(rows_ptr + pair[:, None] * D + d[None, :], mask=mk, other=0.0)
        acc += w[:, None] * r.to(tl.float32)
    if SHARED:  # after the sum, as the unfused `y += shared`; then to nearest even (the
        # interpreter's cast truncates; on the GPU rounding twice changes nothing)
        acc += tl.load(s_ptr + t.to(tl.int64)[:, None] * D + d[None, :], mask=mk).to(tl.float32)
        acc = bf16_rne(acc)
    tl.store(y_ptr + t.to(tl.int64)[:, None] * D + d[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=mk)  # fmt: skip


def _config(num_pairs: int, num_experts: int, on_gpu: bool, format: str = "bf16") -> dict:
    if not on_gpu:  # interpreter: few, large programs
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1)
    per_expert = num_pairs / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    cfg = dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=64, GROUP_M=4 if block_m == 64 else 8,
               num_warps=8 if block_m == 64 else 4, num_stages=3)  # fmt: skip
    if format != "bf16" and block_m == 16:  # decode: H200, 1-64 tokens, 1.05-1.35x (moe_tile)
        cfg.update(SWAP_AB=True, BLOCK_N=64)
    return cfg


def moe_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    format: str = "bf16",
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    limit: float | None = None,
    *,
    skip: bool = False,
    tune: dict | None = None,
    activations: str = "bf16",
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts: x [T, D] bf16, expert_ids [T, K] int, weights [T, K] fp32, w13/w2 (and
    scales) in `format` (see the module doc) -> y [T, D] fp32 = sum_k w * expert(x); with
    `shared` [T, D] (x's dtype, the shared expert's output) y = x.dtype(sum + shared) in fp32,
    what `y += shared; y.to(x.dtype)` gave, in the combine's launch (decode: 2 fewer). `skip`:
    pairs with a negative id add nothing and cost no GEMM tile (an expert-parallel rank's
    pairs of the other ranks' experts). `tune`: config overrides (BLOCK_M/N/K, GROUP_M,
    num_warps, num_stages, SWAP_AB, DEQUANT, CHUNK_EXPERTS, DOT_SCALED; GEMV and
    moe_gemv.gemv_config's keys). `activations` "fp8": W4A8 above the GEMV's sizes
    (`uses_w4a8`, kernels/moe_w4a8.py)."""
    if expert_ids.numel() == 0:
        y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        return y if shared is None else (y + shared.float()).to(x.dtype)
    # the combine stores every element: no zero fill (one launch fewer)
    y = torch.empty(x.shape, dtype=torch.float32 if shared is None else x.dtype, device=x.device)
    # skipped pairs' rows are never written: zeros, so that the combine adds exactly 0 for them
    # whatever their weight (0 * an uninitialised NaN would not be 0)
    rows = None
    if skip:
        rows = torch.zeros(expert_ids.numel(), x.shape[1], dtype=torch.bfloat16, device=x.device)
    rows = expert_rows(x, expert_ids, w13, w2, format, w13_scale, w2_scale, limit,
                       rows=rows, skip=skip, tune=tune, activations=activations)  # fmt: skip
    return _combine(rows, weights, y, expert_ids.shape[1], shared)


def expert_rows(x: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                format: str = "bf16", w13_scale: torch.Tensor | None = None,
                w2_scale: torch.Tensor | None = None, limit: float | None = None, *,
                rows: torch.Tensor | None = None, num_experts: int | None = None,
                skip: bool = False, used_rows: torch.Tensor | None = None,
                tune: dict | None = None, activations: str = "bf16") -> torch.Tensor:  # fmt: skip
    """Steps 1-3 of the module doc: rows [T*K, D] bf16, rows[t*K + k] = bf16(W2_e h) of the
    pair's storage row e = expert_ids[t, k] (x [T, D] bf16; `rows` given: written in place).
    `num_experts`: the expert count the tile, GEMV / MMA and dequant choices read (default
    w13.shape[0]): an expert pool (dsv4/runner/paged/expert_pool.py) passes the model's E, not
    its storage rows, so its math is that of the all-resident call. `skip`: pairs with e < 0
    are not computed (their rows keep what they held: an earlier round's). `used_rows` (int32
    [U] on the device, distinct): every storage row a pair names, given by a caller that knows
    them (a pool's round): the bf16-scratch path then dequantises only those, not all rows.
    `activations` "fp8": MMA-sized steps of "mxfp4_halves128" experts run W4A8
    (kernels/moe_w4a8.py; `uses_w4a8` says when)."""
    assert format in FORMATS, format
    assert x.dim() == 2 and x.dtype == torch.bfloat16 and x.stride(1) == 1
    dim = x.shape[1]
    topk = expert_ids.shape[1]
    storage_rows, inter = w13.shape[0], w13.shape[1] // 2
    num_experts = num_experts or storage_rows
    assert w2.shape[:2] == (storage_rows, dim) and w13.stride(2) == w2.stride(2) == 1
    assert format == "bf16" or (w13_scale is not None and w2_scale is not None)
    num_pairs = expert_ids.numel()
    if rows is None:
        rows = torch.empty(num_pairs, dim, dtype=torch.bfloat16, device=x.device)
    if num_pairs == 0:
        return rows
    if uses_w4a8(num_pairs, num_experts, format, activations):
        cfg = {**moe_w4a8.w4a8_config(num_pairs, num_experts, x.is_cuda), **(tune or {})}
        sorted_ids, tile_e = _align(expert_ids, storage_rows, cfg["BLOCK_M"], skip)
        moe_w4a8.w4a8_gemms(x, sorted_ids, tile_e, w13, w2, (w13_scale, w2_scale), rows, topk,
                            limit, cfg)  # fmt: skip
        return rows
    tune = dict(tune or {})
    # candidates (kernels/moe_mxfp4.py): "mxfp4" through tl.dot_scaled; the "halves" layouts
    dot_scaled, halves = tune.pop("DOT_SCALED", False), moe_mxfp4.halves_block(format)
    assert not dot_scaled or format == "mxfp4", format
    # HALVES_FP32: the halves kernel's GPU upcast through fp32 bits, or through bf16 bits
    fp32 = tune.pop("HALVES_FP32", HALVES_FP32_DEFAULT)
    fmt = (FMT_DOT_SCALED if dot_scaled else (FMT_HALVES_FP32 if fp32 else FMT_HALVES) if halves
           else FORMATS.index(format))  # fmt: skip
    path = served_path(num_pairs, num_experts, format)
    # prefill-sized MXFP4: the experts through a bf16 scratch, chunk by chunk (kernels/moe_dequant)
    dequant = tune.pop("DEQUANT", fmt == 2 and path == "dequant")
    chunk_experts = tune.pop("CHUNK_EXPERTS", None)  # the scratch's experts (default: 1 GiB)
    # decode-sized MXFP4: a batched GEMV on the CUDA cores (kernels/moe_gemv.py)
    gemv = tune.pop("GEMV", path == "gemv" and not dequant and not dot_scaled
                    and not tune.keys() & _MMA_KEYS)  # fmt: skip
    if gemv:
        assert format in moe_gemv.GEMV_FORMATS and not dequant, format
        cfg = {**moe_gemv.gemv_config(num_pairs, num_experts, x.is_cuda, format), **tune}
    elif fmt >= FMT_DOT_SCALED:
        cfg = {**moe_mxfp4.mx_config(num_pairs, num_experts, x.is_cuda, halves), **tune}
    else:
        cfg = {**_config(num_pairs, num_experts, x.is_cuda, "bf16" if dequant else format), **tune}
    swap_ab = bool(cfg.pop("SWAP_AB", SWAP_AB_DEFAULT))
    if not dequant and not gemv:
        bk = cfg["BLOCK_K"]
        assert format != "fp8" or 128 % bk == 0, "an FP8 K step must sit in one scale block"
        # MXFP4 K steps and masks work in whole scale groups of 32 columns
        assert fmt not in (2, 3) or bk % 32 == dim % 32 == inter % 32 == 0, (bk, dim, inter)
        assert not halves or (bk == halves and dim % bk == inter % bk == 0), (bk, dim, inter)
    sorted_ids, tile_e = _align(expert_ids, storage_rows, cfg["BLOCK_M"], skip)
    scales = (w13_scale, w2_scale)
    if gemv:
        moe_gemv.gemv_gemms(x, sorted_ids, tile_e, w13, w2, scales, rows, topk, limit, cfg, format)
        return rows
    h = torch.empty(sorted_ids.numel(), inter, dtype=torch.bfloat16, device=x.device)
    gemms = (x, sorted_ids, tile_e, w13, w2, scales, h, rows, topk, limit)
    if dequant:
        gemms_through_scratch(*gemms, format, cfg, chunk_experts, used_rows)
    else:
        grouped_gemms(*gemms, fmt, cfg, swap_ab)
    return rows


def served_path(num_pairs: int, num_experts: int, format: str) -> str:
    """The path `expert_rows` takes untuned: "gemv" (decode-sized MXFP4, the stored or the
    "mxfp4_halves128" layout: kernels/moe_gemv.py), "dequant" (prefill-sized MXFP4 in the stored
    layout: kernels/moe_dequant.py), else "mma" (this module's kernels; a "halves" layout above
    the GEMV's sizes, whatever the size: kernels/moe_mxfp4.py)."""
    if use_dequant(num_pairs, num_experts, format, True):  # one rule on CPU and GPU
        return "dequant"
    if GEMV_DEFAULT and moe_gemv.use_gemv(num_pairs, num_experts, format):
        return "gemv"
    return "mma"


ACTIVATIONS = ("bf16", "fp8")  # `features.moe_activations`


def uses_w4a8(num_pairs: int, num_experts: int, format: str, activations: str) -> bool:
    """Whether a step runs W4A8 (kernels/moe_w4a8.py): activations "fp8", experts in the
    "mxfp4_halves128" layout, and a step the halves MMA kernel would serve (above the GEMV's
    sizes; decode-sized steps stay exact: weight-bound, FP8 MMA buys them nothing)."""
    assert activations in ACTIVATIONS, activations
    return (activations == "fp8" and format == moe_w4a8.FORMAT
            and served_path(num_pairs, num_experts, format) == "mma")  # fmt: skip


def _align(expert_ids: torch.Tensor, storage_rows: int, block_m: int, skip: bool):
    """`moe_align` over the storage rows; with `skip`, pairs with a negative row go to one
    more (virtual) expert whose tiles are then marked unused (-1: they exit at once)."""
    # NOTE: the one-launch align on CUDA; under the CPU interpreter its in-register sort costs
    # ~0.2 s a call (its own tests cover it), so the engine's interpreted runs use the torch ops
    align = moe_align if expert_ids.is_cuda else moe_align_ref
    if not skip:
        return align(expert_ids, storage_rows, block_m)
    ids = torch.where(expert_ids >= 0, expert_ids, storage_rows)
    sorted_ids, tile_e = align(ids, storage_rows + 1, block_m)
    return sorted_ids, torch.where(tile_e < storage_rows, tile_e, -1)


def combine_rows(
    rows: torch.Tensor, weights: torch.Tensor, logical_ids: torch.Tensor
) -> torch.Tensor:
    """y [T, D] fp32 = sum_k weights[t, k] * rows[t*K + k], k ascending (`expert_rows`' rows;
    `logical_ids` [T, K] only order the reference's sum)."""
    num_tokens, topk = weights.shape
    y = torch.empty(num_tokens, rows.shape[1], dtype=torch.float32, device=rows.device)
    return _combine(rows, weights, y, topk) if num_tokens else y  # it stores every element


def _combine(rows: torch.Tensor, weights: torch.Tensor, y: torch.Tensor, topk: int,
             shared: torch.Tensor | None = None):  # fmt: skip
    """y [T, D] (fp32, or shared's dtype) = sum_k weights[t, k] * rows[t*K + k] (+ shared [T, D]
    in fp32) (`_moe_combine_kernel`)."""
    assert shared is None or (shared.shape == y.shape and shared.is_contiguous()
                              and shared.dtype == y.dtype == torch.bfloat16)  # fmt: skip
    num_tokens, dim = y.shape
    block_t, block_d = (4, 1024) if y.is_cuda else (triton.next_power_of_2(num_tokens), 4096)
    block_d = min(block_d, triton.next_power_of_2(dim))
    _moe_combine_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(dim, block_d))](
        rows, weights.float().contiguous(), y if shared is None else shared, y, num_tokens, dim,
        TOPK=topk, SHARED=shared is not None, BLOCK_T=block_t, BLOCK_D=block_d,
    )  # fmt: skip
    return y


def moe_experts_dequant(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    format: str,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    limit: float | None = None,
    chunk_experts: int | None = None,
) -> torch.Tensor:
    """`moe_experts` made to take the bf16-scratch path whatever the batch (kernels/moe_dequant.py): x [T, D] bf16,
    expert_ids [T, K], weights [T, K] -> y [T, D] fp32."""
    tune = {"DEQUANT": True, "CHUNK_EXPERTS": chunk_experts}
    return moe_experts(x, expert_ids, weights, w13, w2, format, w13_scale, w2_scale, limit,
                       tune=tune)  # fmt: skip


def _expert_ref(x, e: int, w13, w2, format: str, w13_scale, w2_scale, limit, w4a8: bool):
    """Storage row e's expert on x [n, D]: `swiglu` over its weights dequantised to x's dtype,
    or with `w4a8` the W4A8 numerics over `w4a8_weight`s (halves128 codes unpacked first)."""
    inter = w13.shape[1] // 2
    s13, s2 = (None if s is None else s[e] for s in (w13_scale, w2_scale))
    if w4a8:
        block = moe_mxfp4.halves_block(format)
        w13_e, w2_e = (w4a8_weight(moe_mxfp4.unpack_halves(w[e], block), sc)
                       for w, sc in ((w13, s13), (w2, s2)))  # fmt: skip
        return w4a8_swiglu(x, w13_e[:inter], w2_e, w13_e[inter:], limit)
    w13_e = dequantize_expert(w13[e], s13, format, x.dtype)
    w2_e = dequantize_expert(w2[e], s2, format, x.dtype)
    return swiglu(x, w13_e[:inter], w2_e, w13_e[inter:], limit)


def moe_experts_ref(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    format: str = "bf16",
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    limit: float | None = None,
    *,
    skip: bool = False,
    activations: str = "bf16",
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference (and the slow path): the model's loop over experts of `swiglu`, with each
    expert's weights dequantised first, to x's dtype (an fp32 model on CPU stays fp32).
    `skip`: pairs with a negative id add nothing. `activations` "fp8": W4A8 numerics
    (dsv4/ops/w4a8.py) where `uses_w4a8` says the kernel runs them. `shared`: added after the
    sum, the result in x's dtype (`moe_experts`)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    ids = expert_ids.long()
    w4a8 = uses_w4a8(ids.numel(), w13.shape[0], format, activations)
    for e in ids.unique().tolist():
        if skip and e < 0:
            continue
        token_idx, slot = torch.where(ids == e)
        y = _expert_ref(x[token_idx], e, w13, w2, format, w13_scale, w2_scale, limit, w4a8)
        out.index_add_(0, token_idx, y.float() * weights[token_idx, slot].unsqueeze(-1))
    return out if shared is None else (out + shared.float()).to(x.dtype)


def expert_rows_ref(x, expert_ids, w13, w2, format="bf16", w13_scale=None, w2_scale=None,
                    limit=None, *, rows=None, num_experts=None, skip=False,
                    used_rows=None, activations="bf16") -> torch.Tensor:  # fmt: skip
    """Reference of `expert_rows`, computed as `moe_experts_ref` computes each expert (one call
    per storage row on its pairs' tokens, ascending), so `combine_rows_ref` of these rows is
    `moe_experts_ref` bit for bit. Rows in x's dtype; pairs with a negative row are skipped.
    `used_rows` changes nothing here (it saves the kernel's dequantise work)."""
    del used_rows
    topk = expert_ids.shape[1]
    if rows is None:
        rows = torch.zeros(expert_ids.numel(), x.shape[1], dtype=x.dtype, device=x.device)
    ids = expert_ids.long()
    w4a8 = uses_w4a8(ids.numel(), num_experts or w13.shape[0], format, activations)
    for e in ids.unique().tolist():
        if e < 0:
            continue
        token_idx, slot = torch.where(ids == e)
        y = _expert_ref(x[token_idx], e, w13, w2, format, w13_scale, w2_scale, limit, w4a8)
        rows[token_idx * topk + slot] = y.to(rows.dtype)
    return rows


def combine_rows_ref(
    rows: torch.Tensor, weights: torch.Tensor, logical_ids: torch.Tensor
) -> torch.Tensor:
    """`moe_experts_ref`'s sum over `expert_rows_ref`'s rows: per token, w * row in fp32 added
    in ascending logical expert order (its index_add_ order), whatever rows the experts sat in."""
    num_tokens, topk = weights.shape
    order = torch.argsort(logical_ids.long(), dim=1, stable=True)  # [T, K]
    r, t = rows.view(num_tokens, topk, -1), torch.arange(num_tokens, device=rows.device)
    y = torch.zeros(num_tokens, rows.shape[1], dtype=torch.float32, device=rows.device)
    for j in range(topk):
        k = order[:, j]
        y += r[t, k].float() * weights[t, k].float().unsqueeze(-1)
    return y


def shared_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, format: str = "bf16",
                  w13_scale=None, w2_scale=None, limit=None) -> torch.Tensor:  # fmt: skip
    """The shared expert through the same kernels: every token to "expert 0" with weight 1.
    w13 [2I, D(/2)], w2 [D, I(/2)] (and scales) of the one expert."""
    ids = torch.zeros(x.shape[0], 1, dtype=torch.int32, device=x.device)
    ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
    unsq = lambda s: None if s is None else s.unsqueeze(0)  # noqa: E731
    return moe_experts(x, ids, ones, w13.unsqueeze(0), w2.unsqueeze(0), format, unsq(w13_scale),
                       unsq(w2_scale), limit)  # fmt: skip


register_op("moe_experts", moe_experts, moe_experts_ref, family="moe")
register_op("expert_rows", expert_rows, expert_rows_ref, family="moe")
register_op("combine_rows", combine_rows, combine_rows_ref, family="moe")
