"""FP8 weight-only GEMV for decode rows (DSV4_ARCH.md §7): y [T, G, N] = x [T, G, K] @ W^T, T small.

The tiled kernel in kernels/fp8_linear.py runs its weight tile through `tl.dot` after an
in-register dequantise; on the H200 that reached 0.33-0.63x of cuBLAS on the bf16 weight at
1-16 rows (12-18% of the bandwidth roofline, half the bytes) and 0.03-0.20x at 64 rows, with
SWAP_AB, POST_SCALE and 16-row tiles all within 0.1x of it (docs/BENCHMARKS.md). A decode
product has 1-16 rows, so it needs no MMA at all: each program streams BLOCK_N weight rows
[BLOCK_N, BLOCK_K] as stored (K contiguous, one 128-column scale block a step), dequantises
them in fp32 and accumulates T x BLOCK_N x BLOCK_K products elementwise on the CUDA cores,
reducing over K once at the end. T FMAs per weight byte: near the H200's ~8 FMA/byte balance at
T = 8, so this is a decode kernel (`GEMV_MAX_ROWS` in fp8_linear.py). K is split across
programs when the row tiles alone leave SMs idle; partials [S, T, G, N] fp32 add in split order
in `_fp8_linear_reduce_kernel` (deterministic).
No host sync, no data-dependent allocation: CUDA-graph capturable.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.compressor import _bf16_rne
from kernels.fp8_dequant import _block_scale, scale_operand
from kernels.specialize import sizes_vary


@triton.jit(**sizes_vary("T", "split_len"))
def _fp8_gemv_kernel(
    # Pointers: x [T, G, K] (K contiguous), w [G*N, K] e4m3, scales [ceil(G*N/128), ceil(K/128)];
    # out: y [T, G, N] in x's dtype (one split) or fp32 partials [S, T, G, N]
    x_ptr, w_ptr, s_ptr, out_ptr,
    T, N, K, split_len,
    stride_xt, stride_xg, stride_wn, stride_sn, stride_sk, stride_os, stride_ot, stride_og,
    # Meta-parameters
    SCALE_E8M0: tl.constexpr, ROUND_W: tl.constexpr,
    ROUND_OUT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n, pid_s, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = tl.arange(0, BLOCK_T)
    t_ok = t < T
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_row = (g * N + n).to(tl.int64)  # the global weight row (and its scale row)
    w_rows = w_ptr + w_row * stride_wn
    s_rows = s_ptr + (w_row // 128) * stride_sn
    x_rows = x_ptr + t.to(tl.int64) * stride_xt + g * stride_xg
    # products accumulate elementwise across K steps; the one cross-thread reduction over K is
    # after the loop (a tl.sum per step put a shuffle tree on every step: 0.4-0.7x of cuBLAS)
    acc3 = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_K], tl.float32)
    k_lo = pid_s * split_len
    for k0 in range(k_lo, tl.minimum(K, k_lo + split_len), BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        w = tl.load(w_rows[:, None] + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]  # fmt: skip
        x = tl.load(x_rows[:, None] + kk[None, :], mask=t_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_K]  # fmt: skip
        # the dequantised weight (exact for UE8M0; fp32 scales round it to bf16 as the
        # reference's weight is)
        w = w * _block_scale(s_rows, n_ok, k0, stride_sk, SCALE_E8M0)[:, None]
        if ROUND_W:
            w = _bf16_rne(w)
        acc3 += x[:, None, :] * w[None, :, :]
    acc = tl.sum(acc3, axis=2)  # [BLOCK_T, BLOCK_N]
    if ROUND_OUT:  # the interpreter truncates on the cast; the GPU rounds
        acc = _bf16_rne(acc)
    out_rows = (out_ptr + pid_s.to(tl.int64) * stride_os + t.to(tl.int64) * stride_ot
                + g * stride_og)  # fmt: skip
    tl.store(out_rows[:, None] + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & n_ok[None, :])  # fmt: skip


@triton.jit(**sizes_vary("total", "num_partials"))
def _fp8_linear_reduce_kernel(part_ptr, y_ptr, total, num_partials, ROUND_BF16: tl.constexpr,
                              BLOCK: tl.constexpr):  # fmt: skip
    """y[i] = sum_s part[s, i] in s order (fp32), cast to y's dtype; part [S, total]."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < total
    acc = tl.zeros([BLOCK], tl.float32)
    parts = part_ptr + i
    for _ in range(num_partials):
        acc += tl.load(parts, mask=ok, other=0.0)
        parts += total  # a pointer step: no int32 product s * total
    if ROUND_BF16:
        acc = _bf16_rne(acc)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=ok)


def split_k(k: int, block_k: int, splits: int) -> tuple[int, int]:
    """(columns of K per split, a multiple of block_k; the splits that leaves)."""
    steps = triton.cdiv(k, block_k)
    per_split = triton.cdiv(steps, splits)
    return per_split * block_k, triton.cdiv(steps, per_split)


def split_output(y: torch.Tensor, splits: int) -> torch.Tensor:
    """Where the kernel stores: y itself for one split, else fp32 partials [S, *y.shape]."""
    if splits == 1:
        return y
    return torch.empty(splits, *y.shape, dtype=torch.float32, device=y.device)


def reduce_splits(out: torch.Tensor, y: torch.Tensor, round_bf16: bool) -> None:
    """y = the partials `out` [S, *y.shape] added in split order (nothing for one split)."""
    if out is y:
        return
    total, block = y.numel(), 1024
    _fp8_linear_reduce_kernel[(triton.cdiv(total, block),)](
        out, y, total, out.shape[0], ROUND_BF16=round_bf16, BLOCK=block)  # fmt: skip


GEMV_ROWS_LIMIT = 64  # BLOCK_T x BLOCK_N x BLOCK_K products live in registers


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def gemv_config(rows: int, n: int, k: int, groups: int, device: torch.device) -> dict:
    """Row tile and K split of the GEMV: BLOCK_T covers the rows; ~4 programs per SM."""
    block_t = triton.next_power_of_2(max(rows, 1))
    if device.type != "cuda":  # interpreter: few, large programs
        return dict(BLOCK_T=block_t, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=1, splits=1)
    # the [T, BLOCK_N, BLOCK_K] accumulator: 32 fp32 registers a thread at 2 warps (H200 sweep:
    # BLOCK_K 128 best at 1-2 rows)
    block_n, block_k = (16, 128) if block_t <= 1 else (8, 128) if block_t <= 2 else (4, 64)
    block_k = block_k if block_t <= 4 else 32
    cfg = dict(BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=2, num_stages=3)
    tiles = triton.cdiv(n, block_n) * groups
    sms = num_sms(device.index if device.index is not None else torch.cuda.current_device())
    splits = min(triton.cdiv(4 * sms, tiles), max(1, triton.cdiv(k, cfg["BLOCK_K"]) // 2))
    return {**cfg, "splits": max(1, splits)}


def launch_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, y: torch.Tensor,
                cfg: dict) -> None:  # fmt: skip
    """y [T, G, N] = x [T, G, K] @ W^T per group; `cfg` from `gemv_config` (plus overrides)."""
    rows, groups, k = x.shape
    n = weight.shape[0] // groups
    assert rows <= GEMV_ROWS_LIMIT, f"a GEMV of {rows} rows: the [T, N, K] tile would not fit"
    cfg = dict(cfg)
    assert 128 % cfg["BLOCK_K"] == 0, "a K step must sit in one scale block"
    split_len, splits = split_k(k, cfg["BLOCK_K"], cfg.pop("splits"))
    s, e8m0 = scale_operand(scale)
    out = split_output(y, splits)
    round_bf16 = x.dtype == torch.bfloat16
    on_gpu = x.is_cuda
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), splits, groups)
    _fp8_gemv_kernel[grid](
        x, weight, s, out, rows, n, k, split_len,
        x.stride(0), x.stride(1), weight.stride(0), s.stride(0), s.stride(1),
        out.stride(0) if splits > 1 else 0, out.stride(-3), out.stride(-2),
        SCALE_E8M0=e8m0, ROUND_W=round_bf16 and not e8m0,
        ROUND_OUT=round_bf16 and splits == 1 and not on_gpu, **cfg,
    )  # fmt: skip
    reduce_splits(out, y, round_bf16 and not on_gpu)
