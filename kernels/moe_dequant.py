"""Prefill MoE over quantised experts: dequantise them to bf16 once, then the bf16 grouped GEMMs.

`kernels.moe.moe_experts` dequantises FP8 / MXFP4 weights in registers inside the GEMM's K loop,
once per (row tile, column tile) that reads them. For MXFP4 the per-element nibble decode
(shifts, masks, a select, an fp32 scale multiply and a cast) dominates at prefill sizes: on the
H200, at V4-Flash shapes (E 256, D 4096, I 2048, K 6), the in-register kernel takes 27.8 ms at
4096 tokens and 47.6 ms at 8192 against 4.9 and 7.9 ms on bf16 experts. A prefill-sized batch
reads every expert's weights many times, so decoding each weight element once is cheaper: this
module writes a chunk of experts to a bf16 scratch (0.5 B read + 2 B written per MXFP4 element,
1 + 2 B for FP8) and runs the grouped GEMMs (kernels/moe_gemm.py) with FMT=0 on it. All 256 experts are 6.4 G
elements; the pass takes ~7.5 ms on the H200 (half the copy bandwidth), so the whole call is
12.8 / 15.9 ms at 4096 / 8192 tokens (benchmarks/results/kernels-moe-dequant-h200.json). The
values are identical (e2m1 x 2^k and e4m3 x 2^k are exact in bf16; an fp32 FP8 scale rounds to
nearest as `dequantize` does), so outputs match the in-register path up to fp32 summation order.
FP8 in registers won at every size measured (9.7 against 13.9 ms at 8192 tokens), so only MXFP4
takes this path (`use_dequant`).

`moe.moe_experts` takes this path (`use_dequant`, or tune DEQUANT) around its own align and
combine: per chunk of experts [e0, e1), `gemms_through_scratch` dequantises w13 and w2 into one
reused scratch (allocated once per call, at most SCRATCH_BYTES), remaps tile_e to the chunk
(tile_e - e0 inside it, else -1: those tiles exit at once) and runs `moe_gemm.grouped_gemms` in bf16.
No host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops.limits import MOE_DEQUANT_MIN_PAIRS_PER_EXPERT, MOE_DEQUANT_SCRATCH_BYTES
from kernels.jit_helpers import bf16_rne, e2m1_value
from kernels.moe_gemm import FORMATS, dequantize_expert, grouped_gemms, scale_args
from kernels.specialize import sizes_vary

DEQUANT_FORMATS = ("fp8", "mxfp4")
# Bound of the bf16 scratch of one chunk. A V4-Flash expert is 3 * 4096 * 2048 bf16 elements =
# 48 MiB, so a chunk is 21 experts (1008 MiB) and 256 experts take 13 chunks.
SCRATCH_BYTES = MOE_DEQUANT_SCRATCH_BYTES  # 1 GiB (dsv4.ops.limits: the planner counts it)
# Average (token, slot) pairs per expert from which `moe_experts` takes this path. On the H200
# (V4-Flash experts, benchmarks/results/kernels-moe-dequant-h200.json) MXFP4 in registers took
# 6.1 ms at 24 pairs an expert (1024 tokens) against 10.9 ms here, and 27.8 / 47.6 ms at 96 / 192
# against 12.8 / 15.9 ms: the crossover is near 40. FP8 in registers won at every size (9.7 ms
# against 13.9 ms at 8192 tokens), so FP8 never takes it.
DEQUANT_MIN_PAIRS_PER_EXPERT = MOE_DEQUANT_MIN_PAIRS_PER_EXPERT  # 48 (dsv4.ops.limits)
# Dequantise tiles: BLOCK_R and BLOCK_C divide 128, so an FP8 tile sits in one scale block.
_BLOCK_R, _BLOCK_C = 32, 128


@triton.jit(**sizes_vary("e0"))
def _experts_dequant_kernel(
    # Pointers: w [E, rows, cols] e4m3 or [E, rows, cols/2] packed e2m1; its scales;
    # output [e1 - e0, rows, cols] bf16; with HAS_IDS the experts ids[e0:e1] (int32 [U])
    w_ptr, s_ptr, out_ptr, ids_ptr,
    # Sizes, strides (elements)
    e0, rows, cols,
    stride_we, stride_wr, stride_se, stride_sr, stride_sc, stride_oe, stride_or,
    # Meta-parameters
    FMT: tl.constexpr, SCALE_E8M0: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_IDS: tl.constexpr,
):  # fmt: skip
    pid_c, pid_r, pid_e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if HAS_IDS:
        e = tl.load(ids_ptr + e0 + pid_e).to(tl.int64)
    else:
        e = (e0 + pid_e).to(tl.int64)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    r_ok = r < rows
    w_rows = w_ptr + e * stride_we + r.to(tl.int64)[:, None] * stride_wr
    s_e = s_ptr + e * stride_se
    if FMT == 2:  # MXFP4: BLOCK_C/2 bytes a row, one UE8M0 scale per 32 columns
        kh = pid_c * (BLOCK_C // 2) + tl.arange(0, BLOCK_C // 2)
        mk = r_ok[:, None] & (2 * kh < cols)[None, :]
        packed = tl.load(w_rows + kh[None, :], mask=mk, other=0).to(tl.int32) & 0xFF
        ks = pid_c * (BLOCK_C // 32) + tl.arange(0, BLOCK_C // 32)
        s_at = s_e + r.to(tl.int64)[:, None] * stride_sr + ks[None, :] * stride_sc
        sb = tl.load(s_at, mask=r_ok[:, None] & (ks * 32 < cols)[None, :], other=127)
        scale = ((sb.to(tl.int32) & 0xFF) << 23).to(tl.float32, bitcast=True)  # 2^(byte - 127)
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], [BLOCK_R, BLOCK_C // 32, 16]),
                           [BLOCK_R, BLOCK_C // 2])  # fmt: skip
        lo = e2m1_value(packed & 15) * scale  # even columns
        hi = e2m1_value(packed >> 4) * scale  # odd columns
        w = tl.reshape(tl.join(lo, hi), [BLOCK_R, BLOCK_C])
    else:  # FP8 e4m3, the tile's one 128x128 block scale
        mk = r_ok[:, None] & (c < cols)[None, :]
        w = tl.load(w_rows + c[None, :], mask=mk, other=0.0).to(tl.float32)
        s_at = s_e + (pid_r * BLOCK_R // 128) * stride_sr + (pid_c * BLOCK_C // 128) * stride_sc
        if SCALE_E8M0:
            scale = ((tl.load(s_at).to(tl.int32) & 0xFF) << 23).to(tl.float32, bitcast=True)
        else:
            scale = tl.load(s_at)
        w = w * scale
    out_at = out_ptr + pid_e.to(tl.int64) * stride_oe + r.to(tl.int64)[:, None] * stride_or
    # NOTE: rounded in fp32 first: the interpreter truncates fp32 -> bf16 (exact values only
    # reach the store: a no-op there, and for UE8M0 scales everywhere)
    tl.store(out_at + c[None, :], bf16_rne(w).to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & (c < cols)[None, :])  # fmt: skip


def dequantize_experts(
    w: torch.Tensor,
    scale: torch.Tensor,
    format: str,
    e0: int = 0,
    e1: int | None = None,
    out: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Experts [e0, e1) of w [E, rows, cols(/2)] with its scales, in `format` ("fp8" or "mxfp4",
    layouts of kernels/moe.py) -> bf16 [e1 - e0, rows, cols], written to the first e1 - e0
    experts of `out` ([>= e1 - e0, rows, cols] bf16, unit column stride) when given. `ids`
    (int32 [U], on w's device): the experts ids[e0:e1] instead, in that order (read on the
    device: no sync)."""
    assert format in DEQUANT_FORMATS, format
    count = w.shape[0] if ids is None else ids.numel()
    e1 = count if e1 is None else e1
    rows, cols = w.shape[1], w.shape[2] * (2 if format == "mxfp4" else 1)
    assert 0 <= e0 <= e1 <= count and w.stride(2) == 1
    assert ids is None or (ids.dtype == torch.int32 and ids.is_contiguous()), ids
    if out is None:
        out = torch.empty(e1 - e0, rows, cols, dtype=torch.bfloat16, device=w.device)
    assert out.dtype == torch.bfloat16 and out.shape[0] >= e1 - e0 and out.stride(2) == 1
    assert tuple(out.shape[1:]) == (rows, cols), (tuple(out.shape), rows, cols)
    if e1 == e0:
        return out[:0]
    s, e8m0, st = scale_args(scale, w)
    grid = (triton.cdiv(cols, _BLOCK_C), triton.cdiv(rows, _BLOCK_R), e1 - e0)
    _experts_dequant_kernel[grid](
        w, s, out, w if ids is None else ids, e0, rows, cols, w.stride(0), w.stride(1), *st,
        out.stride(0), out.stride(1), FMT=FORMATS.index(format), SCALE_E8M0=e8m0,
        BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C, HAS_IDS=ids is not None, num_warps=4,
    )  # fmt: skip
    return out[: e1 - e0]


def dequantize_experts_ref(
    w: torch.Tensor,
    scale: torch.Tensor,
    format: str,
    e0: int = 0,
    e1: int | None = None,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: `moe_gemm.dequantize_expert` of each expert in [e0, e1) (of `ids`), stacked."""
    experts = list(range(w.shape[0])) if ids is None else ids.tolist()
    experts = experts[e0 : len(experts) if e1 is None else e1]
    if not experts:
        cols = w.shape[2] * (2 if format == "mxfp4" else 1)
        return torch.empty(0, w.shape[1], cols, dtype=torch.bfloat16, device=w.device)
    return torch.stack([dequantize_expert(w[e], scale[e], format) for e in experts])


def use_dequant(num_pairs: int, num_experts: int, format: str, on_gpu: bool) -> bool:
    """Whether `moe_experts` should take `moe_experts_dequant`: MXFP4 experts with, on average,
    at least DEQUANT_MIN_PAIRS_PER_EXPERT pairs an expert (the same rule on the CPU interpreter,
    so tests reach the path). FP8 stays in registers (see the constant)."""
    del on_gpu  # one rule on both
    return format == "mxfp4" and num_pairs >= DEQUANT_MIN_PAIRS_PER_EXPERT * num_experts


def gemms_through_scratch(x, sorted_ids, tile_e, w13, w2, scales, h, rows, topk, limit,
                          format: str, cfg: dict, chunk_experts: int | None = None,
                          used: torch.Tensor | None = None) -> None:  # fmt: skip
    """`moe_gemm.grouped_gemms` on `format` experts by way of a bf16 scratch: per chunk of experts
    [e0, e1), both weights dequantised, tile_e remapped to the chunk (others -1), the bf16 GEMMs
    (cfg: kernels.moe._config's bf16 tiles). `chunk_experts`: experts a chunk (default: as many as fit
    in SCRATCH_BYTES). `used` (int32 [U] on the device, distinct): only these experts are
    dequantised, chunk by chunk of `used`; it must hold every expert a tile of tile_e names (a
    tile of another expert is not computed). An expert pool's round passes its few experts, so
    it does not dequantise every row of its storage (kernels.moe.expert_rows `used_rows`)."""
    assert format in DEQUANT_FORMATS and None not in scales, format
    inter, dim = h.shape[1], rows.shape[1]
    count = w13.shape[0] if used is None else used.numel()
    per_expert = 3 * inter * dim  # bf16 elements of one expert's w13 and w2
    chunk = max(1, min(count, chunk_experts or max(1, SCRATCH_BYTES // (2 * per_expert))))
    scratch = torch.empty(chunk * per_expert, dtype=torch.bfloat16, device=x.device)
    w13_bf16 = scratch[: chunk * 2 * inter * dim].view(chunk, 2 * inter, dim)
    w2_bf16 = scratch[chunk * 2 * inter * dim :].view(chunk, dim, inter)
    for e0 in range(0, count, chunk):
        e1 = min(e0 + chunk, count)
        dequantize_experts(w13, scales[0], format, e0, e1, out=w13_bf16, ids=used)
        dequantize_experts(w2, scales[1], format, e0, e1, out=w2_bf16, ids=used)
        if used is None:
            chunk_tile_e = torch.where((tile_e >= e0) & (tile_e < e1), tile_e - e0, -1)
        else:  # storage row -> its place in the chunk, through a table of E + 1 rows
            place = torch.full((w13.shape[0] + 1,), -1, dtype=tile_e.dtype, device=x.device)
            place[used[e0:e1].long() + 1] = torch.arange(e1 - e0, dtype=tile_e.dtype,
                                                         device=x.device)  # fmt: skip
            place[0] = -1  # unused tiles (-1) stay unused, even if `used` held a -1
            chunk_tile_e = place[tile_e.long().clamp(min=-1) + 1]
        grouped_gemms(x, sorted_ids, chunk_tile_e, w13_bf16, w2_bf16, (None, None), h, rows,
                      topk, limit, 0, cfg)  # fmt: skip
