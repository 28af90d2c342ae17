"""The grouped GEMMs of the routed experts (kernels/moe.py steps 2 and 3), in their own module so
that both `moe.moe_experts` and the bf16-scratch path (kernels/moe_dequant.py) launch them
without importing each other.

`grouped_gemms`: h [P, I] = SwiGLU(W13_e x) over the expert-sorted pairs (`_w13_kernel`), then
rows [T*K, D] = W2_e h (`_w2_kernel`), the weights in one of FORMATS dequantised in registers
(kernels/moe.py's module doc has the formats and the roundings).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops.quant import dequantize
from kernels import moe_mxfp4
from kernels.fp8_dequant import scale_operand
from kernels.jit_helpers import bf16_rne, e2m1_value, swiglu_bf16, tile_ids
from kernels.specialize import sizes_vary

FORMATS = ("bf16", "fp8", "mxfp4", *moe_mxfp4.HALVES_FORMATS)
# FMT codes past FORMATS' first three (kernels/moe_mxfp4.py): "mxfp4" through tl.dot_scaled
# (tune DOT_SCALED), and the "halves" layouts
# and FMT 5, the halves through fp32 bits on the GPU too (kernels/moe.py HALVES_FP32_DEFAULT;
# FMT 4 upcasts to bf16 bits there, kernels/moe_mxfp4.py)
FMT_DOT_SCALED, FMT_HALVES, FMT_HALVES_FP32 = 3, 4, 5


@triton.jit
def _load_a(a_rows, k0, row_ok, K, FMT: tl.constexpr, BLOCK_K: tl.constexpr,
            UPCAST: tl.constexpr):  # fmt: skip
    """The [BLOCK_M, BLOCK_K] activation tile at columns k0.. of rows `a_rows` (pointers);
    for MXFP4 its even and odd columns as two [BLOCK_M, BLOCK_K/2] tiles."""
    kk = k0 + tl.arange(0, BLOCK_K // 2 if FMT >= 4 else BLOCK_K)
    a = tl.load(a_rows[:, None] + kk[None, :], mask=row_ok[:, None] & (kk < K)[None, :], other=0.0)
    if UPCAST and FMT != 3:  # the interpreter computes on raw bf16 bits otherwise
        a = a.to(tl.float32)
    if FMT >= 4:  # "halves": x columns k0.. and k0 + BLOCK_K/2.., each its own load
        a1 = tl.load(a_rows[:, None] + (kk + BLOCK_K // 2)[None, :], mask=row_ok[:, None],
                     other=0.0)  # fmt: skip
        a0, a1 = a, a1.to(a.dtype)
    elif FMT == 2:  # one contiguous load, split into even/odd columns in registers
        a0, a1 = tl.split(tl.reshape(a, [a.shape[0], BLOCK_K // 2, 2]))
    else:
        a0, a1 = a, a
    return a0, a1


@triton.jit
def _mma(acc, a, w, SWAP_AB: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] += a @ w, or with SWAP_AB acc [BLOCK_N, BLOCK_M] += w @ a^T: w
    [BLOCK_N, k] is then the MMA's A operand, which Hopper's wgmma may take from registers (B
    only from shared memory), and the weight rows fill the MMA's M side."""
    if SWAP_AB:
        acc = tl.dot(w, tl.trans(a), acc)
    else:
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _dot_w(acc, a0, a1, w_ptr, s_ptr, n, n_ok, k0, K, stride_wn, stride_sn, stride_sk,
           FMT: tl.constexpr, SCALE_E8M0: tl.constexpr, BLOCK_K: tl.constexpr,
           BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, SWAP_AB: tl.constexpr):  # fmt: skip
    """acc += a @ W[n, k0:k0+BLOCK_K]^T with W dequantised in registers (one expert's w_ptr);
    SWAP_AB: acc^T [BLOCK_N, BLOCK_M] += W[n, k0:k0+BLOCK_K] @ a^T (W tiles [BLOCK_N, BLOCK_K])."""
    kh = tl.arange(0, BLOCK_K // 2)
    ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    kk = k0 + tl.arange(0, BLOCK_K)
    if SWAP_AB:  # weight tiles [BLOCK_N, BLOCK_K(/2)]: W's own layout
        wn, wn_ok = n.to(tl.int64)[:, None], n_ok[:, None]
        kh, ks, kk = kh[None, :], ks[None, :], kk[None, :]
    else:  # weight tiles [BLOCK_K(/2), BLOCK_N]
        wn, wn_ok = n.to(tl.int64)[None, :], n_ok[None, :]
        kh, ks, kk = kh[:, None], ks[:, None], kk[:, None]
    w_rows = w_ptr + wn * stride_wn
    if FMT >= 3:  # kernels/moe_mxfp4.py's candidates
        acc = moe_mxfp4.dot_mx(acc, a0, a1, w_rows, s_ptr + wn * stride_sn, wn_ok, k0, K,
                               stride_sk, FMT, BLOCK_K, BLOCK_N, SWAP_AB)  # fmt: skip
    elif FMT == 2:  # MXFP4: packed bytes, scales per 32 columns
        # NOTE: masked per 32-column scale group (K and k0 are multiples of 32), not per byte:
        # compiled for sm_90, a per-byte mask (2*kh strides by 2) split them into 1-byte loads
        # that were not pipelined
        mk = (k0 + 32 * (kh // 16) < K) & wn_ok
        packed = tl.load(w_rows + (k0 // 2 + kh), mask=mk, other=0).to(tl.int32) & 0xFF
        sb = tl.load(s_ptr + wn * stride_sn + ks * stride_sk, mask=(ks * 32 < K) & wn_ok,
                     other=127).to(tl.int32) & 0xFF  # fmt: skip
        scale = (sb << 23).to(tl.float32, bitcast=True)  # 2^(byte - 127), each over 16 bytes
        if SWAP_AB:
            scale = tl.reshape(tl.broadcast_to(scale[:, :, None], [BLOCK_N, BLOCK_K // 32, 16]),
                               [BLOCK_N, BLOCK_K // 2])  # fmt: skip
        else:
            scale = tl.reshape(tl.broadcast_to(scale[:, None, :], [BLOCK_K // 32, 16, BLOCK_N]),
                               [BLOCK_K // 2, BLOCK_N])  # fmt: skip
        lo = (e2m1_value(packed & 15) * scale).to(a0.dtype)
        hi = (e2m1_value(packed >> 4) * scale).to(a0.dtype)
        acc = _mma(acc, a0, lo, SWAP_AB)
        acc = _mma(acc, a1, hi, SWAP_AB)
    else:
        b = tl.load(w_rows + kk, mask=(kk < K) & wn_ok, other=0.0)
        if FMT == 1:  # FP8 e4m3 with one scale per 128x128 block
            s_off = (wn // 128) * stride_sn + (k0 // 128) * stride_sk
            if SCALE_E8M0:
                sb = tl.load(s_ptr + s_off, mask=wn_ok, other=127).to(tl.int32) & 0xFF
                scale = (sb << 23).to(tl.float32, bitcast=True)
            else:
                scale = tl.load(s_ptr + s_off, mask=wn_ok, other=1.0)
            b = (b.to(tl.float32) * scale).to(a0.dtype)
        elif UPCAST:
            b = b.to(tl.float32)
        acc = _mma(acc, a0, b, SWAP_AB)
    return acc


@triton.jit(**sizes_vary("num_pairs", "num_pid_m"))
def _w13_kernel(
    # Pointers: x [T, D] bf16; sorted pair ids [P] int32; tile expert [P / BLOCK_M] int32;
    # w13 [E, 2I, D(/2)] and its scales; output h [P, I] bf16
    x_ptr, ids_ptr, tile_e_ptr, w_ptr, s_ptr, h_ptr,
    # Sizes, strides (elements), scalars
    num_pairs, D, INTER, num_pid_m,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_h, limit,
    # Meta-parameters
    TOPK: tl.constexpr, FMT: tl.constexpr, SCALE_E8M0: tl.constexpr, HAS_LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, SWAP_AB: tl.constexpr = False,
):  # fmt: skip
    pid_m, pid_n = tile_ids(num_pid_m, tl.cdiv(INTER, BLOCK_N), GROUP_M)
    e = tl.load(tile_e_ptr + pid_m)
    if e >= 0:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(ids_ptr + rows)
        row_ok = pair < num_pairs
        a_rows = x_ptr + (pair // TOPK).to(tl.int64) * stride_x
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < INTER
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        acc_g = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros_like(acc_g)
        for k0 in range(0, D, BLOCK_K):
            a0, a1 = _load_a(a_rows, k0, row_ok, D, FMT, BLOCK_K, UPCAST)
            acc_g = _dot_w(acc_g, a0, a1, w_e, s_e, n, n_ok, k0, D, stride_wn, stride_sn,
                           stride_sk, FMT, SCALE_E8M0, BLOCK_K, BLOCK_N, UPCAST,
                           SWAP_AB)  # fmt: skip
            acc_u = _dot_w(acc_u, a0, a1, w_e, s_e, n + INTER, n_ok, k0, D, stride_wn, stride_sn,
                           stride_sk, FMT, SCALE_E8M0, BLOCK_K, BLOCK_N, UPCAST,
                           SWAP_AB)  # fmt: skip
        h = swiglu_bf16(acc_g, acc_u, limit, HAS_LIMIT)
        if SWAP_AB:  # elementwise so far: one transpose, of h
            h = tl.trans(h)
        h_at = h_ptr + rows.to(tl.int64)[:, None] * stride_h + n[None, :]
        tl.store(h_at, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(**sizes_vary("num_pairs", "num_pid_m"))
def _w2_kernel(
    # Pointers: h [P, I] bf16; sorted pair ids; tile expert; w2 [E, D, I(/2)] and scales;
    # output rows [T*K, D] bf16 (one per (token, slot) pair)
    h_ptr, ids_ptr, tile_e_ptr, w_ptr, s_ptr, out_ptr,
    # Sizes, strides (elements)
    num_pairs, D, INTER, num_pid_m,
    stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_out,
    # Meta-parameters
    FMT: tl.constexpr, SCALE_E8M0: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, SWAP_AB: tl.constexpr = False,
):  # fmt: skip
    pid_m, pid_n = tile_ids(num_pid_m, tl.cdiv(D, BLOCK_N), GROUP_M)
    e = tl.load(tile_e_ptr + pid_m)
    if e >= 0:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(ids_ptr + rows)
        row_ok = pair < num_pairs
        a_rows = h_ptr + rows.to(tl.int64) * stride_h
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < D
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            a0, a1 = _load_a(a_rows, k0, row_ok, INTER, FMT, BLOCK_K, UPCAST)
            acc = _dot_w(acc, a0, a1, w_e, s_e, n, n_ok, k0, INTER, stride_wn, stride_sn, stride_sk,
                         FMT, SCALE_E8M0, BLOCK_K, BLOCK_N, UPCAST, SWAP_AB)  # fmt: skip
        out = bf16_rne(acc)
        if SWAP_AB:
            out = tl.trans(out)
        out_at = out_ptr + pair.to(tl.int64)[:, None] * stride_out + n[None, :]
        tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def scale_args(scale: torch.Tensor | None, like: torch.Tensor):
    if scale is None:  # bf16: a dummy pointer, never read
        return like, True, (0, 0, 0)
    s, e8m0 = scale_operand(scale)
    return s, e8m0, (s.stride(0), s.stride(1), s.stride(2))


def grouped_gemms(x, sorted_ids, tile_e, w13, w2, scales, h, rows, topk, limit, fmt: int,
                  cfg: dict, swap_ab: bool = False) -> None:  # fmt: skip
    """The two GEMMs over the expert-sorted pairs: h [P, I] = SwiGLU(W13_e x), rows [T*K, D] =
    W2_e h, with weights in FORMATS[fmt] and `scales` (w13's, w2's; None for bf16). Row tiles
    whose tile_e is -1 exit at once."""
    num_pairs, dim = rows.shape
    inter, num_pid_m = h.shape[1], tile_e.numel()
    s13, e8m0, st13 = scale_args(scales[0], w13)
    s2, _, st2 = scale_args(scales[1], w2)
    common = dict(FMT=fmt, SCALE_E8M0=e8m0, UPCAST=not x.is_cuda, SWAP_AB=swap_ab, **cfg)
    grid13 = (num_pid_m * triton.cdiv(inter, cfg["BLOCK_N"]),)
    _w13_kernel[grid13](
        x, sorted_ids, tile_e, w13, s13, h,
        num_pairs, dim, inter, num_pid_m,
        x.stride(0), w13.stride(0), w13.stride(1), *st13, h.stride(0),
        float(limit) if limit is not None else 0.0,
        TOPK=topk, HAS_LIMIT=limit is not None, **common,
    )  # fmt: skip
    grid2 = (num_pid_m * triton.cdiv(dim, cfg["BLOCK_N"]),)
    _w2_kernel[grid2](
        h, sorted_ids, tile_e, w2, s2, rows,
        num_pairs, dim, inter, num_pid_m,
        h.stride(0), w2.stride(0), w2.stride(1), *st2, rows.stride(0), **common,
    )  # fmt: skip


def dequantize_expert(w: torch.Tensor, scale: torch.Tensor | None, format: str,
                      dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:  # fmt: skip
    """One expert's weight [rows, cols(/2)] in `format` -> [rows, cols] in `dtype` (bf16: as
    stored; a "halves" layout: unpacked first)."""
    if moe_mxfp4.halves_block(format):
        w, format = moe_mxfp4.unpack_halves(w, moe_mxfp4.halves_block(format)), "mxfp4"
    return w if format == "bf16" else dequantize(w, scale, format, dtype)
