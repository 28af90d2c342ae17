"""W8A8 FP8 linears (issue 21): y [T, G, N] = x [T, G, K] @ W^T with x quantised to e4m3 too.

The activations are quantised per 1x128 group (one fp32 scale per row and 128 columns: amax /
448, DeepGEMM's `per_token_cast_to_fp8`), the weight stays as stored (e4m3, one scale per
128x128 block), and each 128-column K step is one FP8 x FP8 MMA (wgmma on sm_90) whose fp32
sums are scaled by the step's activation scale x weight scale and added to an fp32
accumulator (DeepGEMM's promotion per K block). The weight's bytes go straight from memory
to shared memory, with no dequantise in the MMA's operand path: that is what the weight-only
kernel (kernels/fp8_linear.py) pays for.

It changes the numerics (x is rounded to e4m3, ~2^-4 relative per element), so it is its own
switch (`fp8_linear(..., activations="fp8")`), never the exact path's stand-in; its reference
is `w8a8_linear_ref` (quantise x the same way, dequantise both, F.linear).

Row counts up to SWAP_AB_MAX_ROWS put the weight tile on the MMA's left (its M side, 64+
rows) and the few token rows on its N side (8-256 columns). Split-K (fp32 partials added in
split order by kernels/fp8_gemv.py's reduce) fills the SMs when the tiles alone do not.
No host sync, no data-dependent allocation: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops import fp8 as ref_fp8
from kernels.fp8_dequant import scale_operand
from kernels.fp8_gemv import num_sms, reduce_splits, split_k, split_output
from kernels.jit_helpers import block_scale, store_tile, tile_ids, weight_rows
from kernels.specialize import sizes_vary

GROUP = ref_fp8.FP8_BLOCK  # activation columns per scale (= the weight's scale block)
SWAP_AB_MAX_ROWS = 64


@triton.jit
def _quantize_groups(x):
    """x [R, 128] fp32 -> (x / s in [-448, 448] fp32, s [R]); s = max(amax, 1e-4) / 448
    (dsv4.model.fp8.quantize_activations: FP8_MAX, AMAX_FLOOR)."""
    amax = tl.max(tl.abs(x), axis=1)
    s = tl.maximum(amax, 1e-4) / 448.0
    q = tl.minimum(tl.maximum(x / s[:, None], -448.0), 448.0)
    return q, s


@triton.jit
def _to_e4m3(v, ROUND: tl.constexpr):
    """v fp32 in [-448, 448] -> e4m3. ROUND (the interpreter, whose cast drops the carry of a
    rounding into the exponent: 124.5 -> 64): round to the e4m3 grid in fp32 first (nearest
    even: v + c - c with c = 1.5 * 2^23 ulps), after which the cast is exact."""
    if ROUND:
        e = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # subnormal: 2^-6
        c = ((e + 124) << 23).to(tl.float32, bitcast=True) * 12582912.0  # ulp 2^(e-3) x 1.5 x 2^23
        v = (v + c) - c
    return v.to(tl.float8e4nv)


@triton.jit(**sizes_vary("T"))
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, T, K, stride_xt, stride_qt, stride_st,
                      ROUND: tl.constexpr, BLOCK_T: tl.constexpr):  # fmt: skip
    """q [T, K] e4m3, s [T, ceil(K/128)] fp32 from x [T, K] (a [T, G, K] input as [T*G, K])."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    kk = tl.program_id(1) * 128 + tl.arange(0, 128)
    ok = (t < T)[:, None] & (kk < K)[None, :]
    t64 = t.to(tl.int64)
    x = tl.load(x_ptr + t64[:, None] * stride_xt + kk[None, :], mask=ok, other=0.0)
    q, s = _quantize_groups(x.to(tl.float32))
    tl.store(q_ptr + t64[:, None] * stride_qt + kk[None, :], _to_e4m3(q, ROUND), mask=ok)
    tl.store(s_ptr + t64 * stride_st + tl.program_id(1), s, mask=t < T)


@triton.jit(**sizes_vary("T", "split_len"))
def _fp8_w8a8_kernel(
    # Pointers (N = out_features): x [T, G, K] (e4m3, or x's dtype with FUSE_QUANT), its scales xs [T, G, ceil(K/128)]
    # fp32 (unused with FUSE_QUANT); w [G*N, K] e4m3 and its scales [ceil(G*N/128), ceil(K/128)];
    # out: y [T, G, N] (one split) or fp32 partials [S, T, G, N]
    x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr,
    T, out_features, K, split_len,
    stride_xt, stride_xg, stride_xst, stride_xsg, stride_wn, stride_sn, stride_sk,
    stride_os, stride_ot, stride_og,
    # Meta-parameters
    SCALE_E8M0: tl.constexpr, FUSE_QUANT: tl.constexpr, UPCAST: tl.constexpr,
    SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tile_ids(tl.cdiv(T, BLOCK_M), tl.cdiv(out_features, BLOCK_N), GROUP_M)
    pid_s, g = tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < out_features
    w_rows, s_rows = weight_rows(w_ptr, s_ptr, g, out_features, n, stride_wn, stride_sn)
    x_rows = x_ptr + rows.to(tl.int64) * stride_xt + g * stride_xg
    xs_rows = xs_ptr + rows.to(tl.int64) * stride_xst + g * stride_xsg
    # SWAP_AB: accT [BLOCK_N, BLOCK_M] = W_tile @ xq_tile^T (the weight rows on the MMA's M side)
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], tl.float32)
    # split_len is a multiple of the K step: written so, k0 is known to be one (vector loads)
    k_lo = pid_s * split_len // 128 * 128
    for k0 in range(k_lo, tl.minimum(K, k_lo + split_len), 128):
        kk = k0 + tl.arange(0, 128)
        k_ok = kk < K
        w = tl.load(w_rows[:, None] + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_N, 128] e4m3, K contiguous (the MMA's K-major operand)  # fmt: skip
        x_ok = row_ok[:, None] & k_ok[None, :]
        if FUSE_QUANT:  # x in its own dtype: quantise this step's [BLOCK_M, 128] group here
            xf, xs = _quantize_groups(tl.load(x_rows[:, None] + kk[None, :], mask=x_ok,
                                              other=0.0).to(tl.float32))  # fmt: skip
            xq = _to_e4m3(xf, UPCAST)
        else:
            xq = tl.load(x_rows[:, None] + kk[None, :], mask=x_ok, other=0.0)  # [BLOCK_M, 128]
            xs = tl.load(xs_rows + k0 // 128, mask=row_ok, other=0.0)  # [BLOCK_M]
        ws = block_scale(s_rows, n_ok, k0, stride_sk, SCALE_E8M0)  # [BLOCK_N]
        if UPCAST:  # the interpreter has no e4m3 MMA: exact fp32 products of the same values
            w, xq = w.to(tl.float32), xq.to(tl.float32)
        if SWAP_AB:
            acc += tl.dot(w, tl.trans(xq)) * (ws[:, None] * xs[None, :])
        else:
            acc += tl.dot(xq, tl.trans(w)) * (xs[:, None] * ws[None, :])
    store_tile(out_ptr, acc, pid_s, rows, row_ok, g, n, n_ok, stride_os, stride_ot, stride_og,
                SWAP_AB)  # fmt: skip


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, G, K] -> (e4m3 [T, G, K], fp32 scales [T, G, ceil(K/128)]), one 1x128 group a scale."""
    rows, groups, k = x.shape
    flat = x.reshape(rows * groups, k)
    q = torch.empty(rows * groups, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(rows * groups, triton.cdiv(k, GROUP), dtype=torch.float32, device=x.device)
    if rows * groups:
        block_t = 16
        _act_quant_kernel[(triton.cdiv(rows * groups, block_t), triton.cdiv(k, GROUP))](
            flat, q, s, rows * groups, k, flat.stride(0), q.stride(0), s.stride(0),
            ROUND=not x.is_cuda, BLOCK_T=block_t, num_warps=4)  # fmt: skip
    return q.view(rows, groups, k), s.view(rows, groups, -1)


def w8a8_config(rows: int, n: int, k: int, groups: int, device: torch.device) -> dict:
    """Tiles and the K split of a [rows, K] x [N, K]^T W8A8 product per group."""
    if device.type != "cuda":  # interpreter: few, large programs
        return dict(BLOCK_M=32, BLOCK_N=64, GROUP_M=4, SWAP_AB=rows <= SWAP_AB_MAX_ROWS,
                    FUSE_QUANT=False, num_warps=4, num_stages=1, splits=1)  # fmt: skip
    if rows <= SWAP_AB_MAX_ROWS:  # decode: the weight streams through, token rows are MMA N
        # H200 sweep: quantising inside the GEMM (one launch) with 64-row weight tiles is best
        # at 16 rows; the separate quantiser with 128-row tiles at 64
        small = rows <= 16
        cfg = dict(BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=64 if small else 128,
                   GROUP_M=1, SWAP_AB=True, FUSE_QUANT=small, num_warps=4, num_stages=4)  # fmt: skip
    else:  # 64-row tiles measured ahead of 128 at 1024 and 8192 rows
        cfg = dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, SWAP_AB=False, FUSE_QUANT=False,
                   num_warps=4, num_stages=4)  # fmt: skip
    tiles = triton.cdiv(rows, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]) * groups
    steps = triton.cdiv(k, GROUP)
    sms = num_sms(device.index if device.index is not None else torch.cuda.current_device())
    # >= 2 K steps a split; fp32 partials (S x rows x N) no more than ~the weight's bytes
    splits = min(triton.cdiv(sms, tiles), max(1, steps // 2), max(1, k // (4 * rows)))
    return {**cfg, "splits": max(1, splits)}


def launch_w8a8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, y: torch.Tensor,
                cfg: dict) -> None:  # fmt: skip
    """y [T, G, N] = quantised x [T, G, K] @ W^T per group; `cfg` from `w8a8_config` (+ overrides)."""
    rows, groups, k = x.shape
    n = weight.shape[0] // groups
    cfg = dict(cfg)
    fuse = bool(cfg.pop("FUSE_QUANT"))
    if fuse:
        xq, xs = x, x.new_empty(0, dtype=torch.float32).view(0, 1, 1)
    else:
        xq, xs = quantize_activations(x)
    split_len, splits = split_k(k, GROUP, cfg.pop("splits"))
    s, e8m0 = scale_operand(scale)
    out = split_output(y, splits)
    grid = (triton.cdiv(rows, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), splits, groups)
    _fp8_w8a8_kernel[grid](
        xq, xs, weight, s, out, rows, n, k, split_len,
        xq.stride(0), xq.stride(1), xs.stride(0), xs.stride(1),
        weight.stride(0), s.stride(0), s.stride(1),
        out.stride(0) if splits > 1 else 0, out.stride(-3), out.stride(-2),
        SCALE_E8M0=e8m0, FUSE_QUANT=fuse, UPCAST=not x.is_cuda, **cfg,
    )  # fmt: skip
    reduce_splits(out, y, False)


def w8a8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Reference: the model's W8A8 op (x quantised per 1x128 group, dequantised; fp32 product)."""
    return ref_fp8.fp8_linear(x, weight, scale, activations="fp8")


def w8a8_grouped_linear_ref(x: torch.Tensor, weight: torch.Tensor,
                            scale: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Reference: the model's grouped W8A8 op."""
    return ref_fp8.fp8_grouped_linear(x, weight, scale, activations="fp8")
