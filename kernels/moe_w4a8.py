"""W4A8 routed experts (issue 21): MXFP4 experts in the "mxfp4_halves128" layout (kernels/
moe_mxfp4.py) times e4m3 activations on the FP8 tensor cores; numerics and reference in
dsv4/ops/w4a8.py (`features.moe_activations` fp8, its own switch: it rounds x and h to e4m3).

Why: above the GEMV's sizes the halves kernel is bound by its MMA and the upcast beside it
(1024 tokens: 3.0 ms against 1.0 ms of weight bytes on an H100; 8192 tokens: 0.74x bf16).
Hopper's e4m3 MMA runs at twice the bf16 rate and an e2m1 code becomes an e4m3 byte with the
same three integer ops, one fp32 multiply and one conversion as it becomes bf16.

Per K step of 128 columns (one halves128 block, one activation group, four scale groups):
    W_blk = e4m3(e2m1 * 2^(s - r)) [BLOCK_N, 128]      r = the block's largest scale byte s
    acc  += (W_blk @ a_blk^T) * (2^(r - 127) [BLOCK_N, 1] * a_scale [1, BLOCK_M])
SWAP_AB only (the weight is wgmma's register operand A, e4m3 and K-major as stored; a's rows
are operand B from shared memory, K-major as loaded). The activations come quantised:
x by `kernels.fp8_w8a8.quantize_activations` (one launch) before the gate/up kernel, h in that
kernel's epilogue, where one BLOCK_N = 128 column tile of a pair's h is exactly one 1x128 group
(its amax is a reduction over the tile's rows). No host sync: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_w8a8 import _quantize_groups, _to_e4m3, quantize_activations
from kernels.jit_helpers import bf16_rne, swiglu_bf16, tile_ids
from kernels.moe_mxfp4 import _e2m1_bits
from kernels.specialize import sizes_vary

BLOCK_K = tl.constexpr(128)  # the halves128 block = the activation group = the K step
FORMAT = "mxfp4_halves128"  # the expert layout it reads


@triton.jit
def _rel_factors(sb, r):
    """UE8M0 bytes sb [BLOCK_N, 2] of two 32-column groups and their block's largest r
    [BLOCK_N] -> 2^(s - r + 126) broadcast over the groups' columns [BLOCK_N, 64] (s - r clamped
    at -126: the factor stays a normal fp32; e2m1 * 2^-126 times it is e2m1 * 2^(s - r))."""
    f = ((tl.maximum(sb - r[:, None], -126) + 253) << 23).to(tl.float32, bitcast=True)
    return tl.reshape(tl.broadcast_to(f[:, :, None], [sb.shape[0], 2, 32]), [sb.shape[0], 64])


@triton.jit
def _w4a8_block(acc, a0, a1, a_scale, w_rows, s_rows, wn_ok, k0, stride_sk,
                UPCAST: tl.constexpr):  # fmt: skip
    """acc [BLOCK_N, BLOCK_M] += one 128-column K step (module doc). a0 / a1: the e4m3
    activation columns k0.. / k0+64.. [BLOCK_M, 64]; a_scale [BLOCK_M] their group's scale;
    w_rows / s_rows: [BLOCK_N, 1] weight and scale row pointers of the expert."""
    packed = tl.load(w_rows + (k0 // 2 + tl.arange(0, 64)[None, :]), mask=wn_ok, other=0)
    packed = packed.to(tl.int32) & 0xFF  # [BLOCK_N, 64]: low nibble column j, high j + 64
    g = k0 // 32 + tl.arange(0, 2)[None, :]  # the low half's two scale groups; +2: the high's
    s_lo = tl.load(s_rows + g * stride_sk, mask=wn_ok, other=127).to(tl.int32) & 0xFF
    s_hi = tl.load(s_rows + (g + 2) * stride_sk, mask=wn_ok, other=127).to(tl.int32) & 0xFF
    r = tl.maximum(tl.max(s_lo, axis=1), tl.max(s_hi, axis=1))  # [BLOCK_N]
    lo = _to_e4m3(_e2m1_bits(packed) * _rel_factors(s_lo, r), UPCAST)  # exact if s >= r - 8
    hi = _to_e4m3(_e2m1_bits(packed >> 4) * _rel_factors(s_hi, r), UPCAST)
    if UPCAST:  # the interpreter: exact fp32 products of the same e4m3 values
        lo, hi, a0, a1 = lo.to(tl.float32), hi.to(tl.float32), a0.to(tl.float32), a1.to(tl.float32)
    part = tl.dot(lo, tl.trans(a0))
    part = tl.dot(hi, tl.trans(a1), part)  # [BLOCK_N, BLOCK_M] fp32
    w_scale = (r << 23).to(tl.float32, bitcast=True)  # 2^(r - 127); r = 0 counts as 0
    return acc + part * (w_scale[:, None] * a_scale[None, :])


@triton.jit
def _a_block(a_rows, as_rows, row_ok, k0):
    """The e4m3 activation columns k0.. and k0+64.. of rows `a_rows` ([BLOCK_M] pointers),
    [BLOCK_M, 64] each, and their 1x128 group's scale [BLOCK_M] (`as_rows`: scale rows)."""
    kh = k0 + tl.arange(0, BLOCK_K // 2)[None, :]
    a0 = tl.load(a_rows[:, None] + kh, mask=row_ok[:, None], other=0.0)
    a1 = tl.load(a_rows[:, None] + (kh + BLOCK_K // 2), mask=row_ok[:, None], other=0.0)
    return a0, a1, tl.load(as_rows + k0 // BLOCK_K, mask=row_ok, other=0.0)


@triton.jit(**sizes_vary("num_pairs", "num_pid_m"))
def _w13_w4a8_kernel(
    # Pointers: xq [T, D] e4m3 and its scales xs [T, D/128] fp32; sorted pair ids [P] int32;
    # tile expert [P / BLOCK_M] int32; w13 [E, 2I, D/2] halves128 codes, scales [E, 2I, D/32];
    # outputs: hq [P, I] e4m3 and its scales hs [P, I/128] fp32 (sorted order)
    x_ptr, xs_ptr, ids_ptr, tile_e_ptr, w_ptr, s_ptr, h_ptr, hs_ptr,
    num_pairs, D, INTER, num_pid_m,
    stride_x, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_h,
    stride_hs, limit,
    TOPK: tl.constexpr, HAS_LIMIT: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tile_ids(num_pid_m, tl.cdiv(INTER, BLOCK_N), GROUP_M)
    e = tl.load(tile_e_ptr + pid_m)
    if e >= 0:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(ids_ptr + rows)
        row_ok = pair < num_pairs
        tok = (pair // TOPK).to(tl.int64)
        a_rows, as_rows = x_ptr + tok * stride_x, xs_ptr + tok * stride_xs
        n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None]  # [BLOCK_N, 1]
        n_ok = n < INTER
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_u = tl.zeros_like(acc_g)
        for k0 in range(0, D, BLOCK_K):
            a0, a1, a_scale = _a_block(a_rows, as_rows, row_ok, k0)
            acc_g = _w4a8_block(acc_g, a0, a1, a_scale, w_e + n * stride_wn, s_e + n * stride_sn,
                                n_ok, k0, stride_sk, UPCAST)  # fmt: skip
            acc_u = _w4a8_block(acc_u, a0, a1, a_scale, w_e + (n + INTER) * stride_wn,
                                s_e + (n + INTER) * stride_sn, n_ok, k0, stride_sk, UPCAST)  # fmt: skip
        h = tl.trans(swiglu_bf16(acc_g, acc_u, limit, HAS_LIMIT))  # [BLOCK_M, BLOCK_N = 128]
        q, s = _quantize_groups(h)  # one 1x128 group per pair: the w2 kernel's K step
        cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
        rows64 = rows.to(tl.int64)
        tl.store(h_ptr + rows64[:, None] * stride_h + cols, _to_e4m3(q, UPCAST),
                 mask=row_ok[:, None] & (cols < INTER))  # fmt: skip
        tl.store(hs_ptr + rows64 * stride_hs + pid_n, s, mask=row_ok)


@triton.jit(**sizes_vary("num_pairs", "num_pid_m"))
def _w2_w4a8_kernel(
    # Pointers: hq [P, I] e4m3, hs [P, I/128]; sorted pair ids; tile expert; w2 [E, D, I/2]
    # halves128 codes and scales [E, D, I/32]; output rows [T*K, D] bf16 (one per pair)
    h_ptr, hs_ptr, ids_ptr, tile_e_ptr, w_ptr, s_ptr, out_ptr,
    num_pairs, D, INTER, num_pid_m,
    stride_h, stride_hs, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_out,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tile_ids(num_pid_m, tl.cdiv(D, BLOCK_N), GROUP_M)
    e = tl.load(tile_e_ptr + pid_m)
    if e >= 0:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(ids_ptr + rows)
        row_ok = pair < num_pairs
        a_rows = h_ptr + rows.to(tl.int64) * stride_h
        as_rows = hs_ptr + rows.to(tl.int64) * stride_hs
        n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None]
        n_ok = n < D
        w_rows = w_ptr + e.to(tl.int64) * stride_we + n * stride_wn
        s_rows = s_ptr + e.to(tl.int64) * stride_se + n * stride_sn
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            a0, a1, a_scale = _a_block(a_rows, as_rows, row_ok, k0)
            acc = _w4a8_block(acc, a0, a1, a_scale, w_rows, s_rows, n_ok, k0, stride_sk, UPCAST)
        out = tl.trans(bf16_rne(acc))  # [BLOCK_M, BLOCK_N]
        cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
        out_at = out_ptr + pair.to(tl.int64)[:, None] * stride_out + cols
        tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < D))


def w4a8_config(num_pairs: int, num_experts: int, on_gpu: bool) -> dict:
    """Tiles: the weight rows (BLOCK_N = 128, one activation group of h) on the MMA's M side,
    an expert's pairs on its N side (BLOCK_M about its pairs: each weight upcast about once)."""
    if not on_gpu:  # interpreter: few, large programs
        return dict(BLOCK_M=16, BLOCK_N=128, GROUP_M=4, num_warps=4, num_stages=1)
    per_expert = num_pairs / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    return dict(BLOCK_M=block_m, BLOCK_N=128, GROUP_M=4, num_warps=4 if block_m == 16 else 8,
                num_stages=3)  # fmt: skip


def w4a8_gemms(x, sorted_ids, tile_e, w13, w2, scales, rows, topk, limit, cfg: dict) -> None:
    """The two grouped GEMMs of `kernels.moe.expert_rows` in W4A8: x [T, D] bf16 quantised per
    1x128 group, h [P, I] e4m3 from the first kernel's epilogue, rows [T*K, D] bf16 written
    (w13 / w2: halves128 codes, `scales` their UE8M0 scales)."""
    num_pairs, dim = rows.shape
    inter, num_pid_m = w13.shape[1] // 2, tile_e.numel()
    assert dim % 128 == 0 and inter % 128 == 0 and cfg["BLOCK_N"] == 128, (dim, inter, cfg)
    s13, s2 = (s.view(torch.uint8) for s in scales)
    xq, xs = (t.squeeze(1) for t in quantize_activations(x.unsqueeze(1)))  # [T, D], [T, D/128]
    hq = torch.empty(sorted_ids.numel(), inter, dtype=torch.float8_e4m3fn, device=x.device)
    hs = torch.empty(sorted_ids.numel(), inter // 128, dtype=torch.float32, device=x.device)
    tiles = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], GROUP_M=cfg["GROUP_M"],
                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], UPCAST=not x.is_cuda)  # fmt: skip
    _w13_w4a8_kernel[(num_pid_m * triton.cdiv(inter, cfg["BLOCK_N"]),)](
        xq, xs, sorted_ids, tile_e, w13, s13, hq, hs,
        num_pairs, dim, inter, num_pid_m,
        xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1),
        s13.stride(2), hq.stride(0), hs.stride(0), float(limit) if limit is not None else 0.0,
        TOPK=topk, HAS_LIMIT=limit is not None, **tiles,
    )  # fmt: skip
    _w2_w4a8_kernel[(num_pid_m * triton.cdiv(dim, cfg["BLOCK_N"]),)](
        hq, hs, sorted_ids, tile_e, w2, s2, rows,
        num_pairs, dim, inter, num_pid_m,
        hq.stride(0), hs.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        s2.stride(2), rows.stride(0), **tiles,
    )  # fmt: skip
