"""FP8 weight-only GEMV for decode rows: y [T, G, N] = x [T, G, K] @ W^T, T small.
W is an FP8 linear of docs/model.md#fp8-linears.

A decode product has 1-16 rows, so it needs no MMA (the tiled `tl.dot` kernel of
kernels/fp8_linear.py ran at 0.33-0.63x of cuBLAS bf16 there): weight rows stream through the
CUDA cores as stored, dequantised in fp32. T FMAs per weight byte: near the H200's ~8
FMA/byte balance at T = 8, so these are decode kernels (`GEMV_MAX_ROWS` in fp8_linear.py).
- One row, `_fp8_gemv_kernel`: a K step of BLOCK_K columns as [BLOCK_K / VEC, VEC] groups,
  VEC = 16 contiguous bytes a thread (one 16-byte load), so a step spans several 128-column
  scale blocks and each thread has BLOCK_N x BLOCK_K / (16 x threads) such loads in flight
  (8 at the served 16 x 1024 tile, 4 warps). x and the
  weight load as 4-D tiles of one shape ([T, BLOCK_N, BLOCK_K / VEC, VEC], x's pointers
  broadcast over BLOCK_N: L1 hits), so both take one layout: the VEC products sum inside a
  thread with no shuffle, and a UE8M0 scale multiplies each group's sum (exact: a power of two).
  Built for sm_90 with ptxas: 48-120 registers, no spills, no shared memory in the loop. A 3-D
  load broadcast afterwards had sent the weight tile through shared memory every step.
- 2+ rows, `_fp8_gemv_rows_kernel` (the first GEMV): [BLOCK_T, BLOCK_N, BLOCK_K] products
  accumulated elementwise, one scale block a step; the broadcast x of the 1-row kernel costs
  L1 bandwidth x rows (it ran at 0.55-0.95x of this one at 2-4 rows on the H200).
K is split across programs when the row tiles alone leave SMs idle; partials [S, T, G, N] fp32
add in split order in `_fp8_linear_reduce_kernel` (deterministic). The split start is written
as a multiple of BLOCK_K: with `split_len` out of the compile key, a plain `pid * split_len`
hid the alignment and every weight load went out a byte at a time.
No host sync, no data-dependent allocation: CUDA-graph capturable.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.fp8_dequant import scale_operand
from kernels.jit_helpers import bf16_rne, block_scale, scales_at, store_tile, weight_rows
from kernels.specialize import sizes_vary


@triton.jit(**sizes_vary("T", "split_len"))
def _fp8_gemv_kernel(
    # Pointers: x [T, G, K] (K contiguous), w [G*N, K] e4m3, scales [ceil(G*N/128), ceil(K/128)];
    # out: y [T, G, N] in x's dtype (one split) or fp32 partials [S, T, G, N]
    x_ptr, w_ptr, s_ptr, out_ptr,
    T, N, K, split_len,
    stride_xt, stride_xg, stride_wn, stride_sn, stride_sk, stride_os, stride_ot, stride_og,
    # Meta-parameters
    SCALE_E8M0: tl.constexpr, PER_ELEMENT: tl.constexpr, ROUND_W: tl.constexpr,
    ROUND_OUT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,
):  # fmt: skip
    pid_n, pid_s, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = tl.arange(0, BLOCK_T)
    t_ok = t < T
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_rows, s_rows = weight_rows(w_ptr, s_ptr, g, N, n, stride_wn, stride_sn)
    x_rows = x_ptr + t.to(tl.int64) * stride_xt + g * stride_xg
    # a K step is [BLOCK_K // VEC, VEC]: VEC contiguous bytes a thread (one 16-byte load), one
    # scale column per VEC group, so BLOCK_K may span several 128-column scale blocks
    group_k = tl.arange(0, BLOCK_K // VEC) * VEC  # [J]: each VEC group's first column
    vec = group_k[:, None] + tl.arange(0, VEC)[None, :]  # [J, VEC]
    # the VEC products of a group sum inside one thread; the group sums accumulate
    # elementwise across K steps, and the one cross-thread reduction is after the loop
    acc = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_K // VEC], tl.float32)
    # split_len is a multiple of the K step: written so, k0 is known to be one (vector loads)
    k_lo = pid_s * split_len // BLOCK_K * BLOCK_K
    for k0 in range(k_lo, tl.minimum(K, k_lo + split_len), BLOCK_K):
        kk = k0 + vec  # [J, VEC]
        k_ok = kk < K
        # 4-D tiles of one shape (x's pointers broadcast over BN: L1 hits), so x and the weight
        # load in one layout (VEC elements a thread) and the VEC sum stays in-thread; a 3-D
        # load broadcast afterwards went through shared memory and spread VEC over lanes
        w = tl.load(w_rows[None, :, None, None] + kk[None, None, :, :],
                    mask=n_ok[None, :, None, None] & k_ok[None, None, :, :], other=0.0)  # [1, BN, J, VEC] e4m3  # fmt: skip
        x_ptrs = tl.broadcast_to(x_rows[:, None, None, None] + kk[None, None, :, :],
                                 [BLOCK_T, BLOCK_N, BLOCK_K // VEC, VEC])  # fmt: skip
        x = tl.load(x_ptrs, mask=t_ok[:, None, None, None] & k_ok[None, None, :, :], other=0.0)
        # [BN, J] scales: column (k0 + j * VEC) // 128 of each row's scale row
        s_ptrs = s_rows[:, None] + ((k0 + group_k) // 128)[None, :] * stride_sk
        scale = scales_at(s_ptrs, n_ok[:, None], SCALE_E8M0)[None, :, :]
        if PER_ELEMENT:  # fp32 scales: the dequantised weight, rounded as the reference's
            wd = w.to(tl.float32) * scale[:, :, :, None]
            if ROUND_W:
                wd = bf16_rne(wd)
            acc += tl.sum(x.to(tl.float32) * wd, axis=3)
        else:  # power-of-two scales: exact on the group's sum
            acc += tl.sum(x.to(tl.float32) * w.to(tl.float32), axis=3) * scale
    y = tl.sum(acc, axis=2)  # [BLOCK_T, BLOCK_N]
    if ROUND_OUT:  # the interpreter truncates on the cast; the GPU rounds
        y = bf16_rne(y)
    store_tile(out_ptr, y, pid_s, t, t_ok, g, n, n_ok, stride_os, stride_ot,
                stride_og, False)  # fmt: skip


@triton.jit(**sizes_vary("T", "split_len"))
def _fp8_gemv_rows_kernel(
    # Pointers (N = out_features): x [T, G, K] (K contiguous), w [G*N, K] e4m3, scales [ceil(G*N/128), ceil(K/128)];
    # out: y [T, G, N] in x's dtype (one split) or fp32 partials [S, T, G, N]
    x_ptr, w_ptr, s_ptr, out_ptr,
    T, out_features, K, split_len,
    stride_xt, stride_xg, stride_wn, stride_sn, stride_sk, stride_os, stride_ot, stride_og,
    # Meta-parameters
    SCALE_E8M0: tl.constexpr, ROUND_W: tl.constexpr,
    ROUND_OUT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """2+ rows: the [BLOCK_T, BLOCK_N, BLOCK_K] products accumulate elementwise, one K step a
    scale block (the 1-row kernel's broadcast x loads cost L1 bandwidth x rows)."""
    pid_n, pid_s, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = tl.arange(0, BLOCK_T)
    t_ok = t < T
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < out_features
    w_rows, s_rows = weight_rows(w_ptr, s_ptr, g, out_features, n, stride_wn, stride_sn)
    x_rows = x_ptr + t.to(tl.int64) * stride_xt + g * stride_xg
    # products accumulate elementwise across K steps; the one cross-thread reduction over K is
    # after the loop (a tl.sum per step put a shuffle tree on every step: 0.4-0.7x of cuBLAS)
    acc3 = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_K], tl.float32)
    k_lo = pid_s * split_len // BLOCK_K * BLOCK_K  # a multiple of BLOCK_K (vector loads)
    for k0 in range(k_lo, tl.minimum(K, k_lo + split_len), BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        w = tl.load(w_rows[:, None] + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]  # fmt: skip
        x = tl.load(x_rows[:, None] + kk[None, :], mask=t_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_K]  # fmt: skip
        # the dequantised weight (exact for UE8M0; fp32 scales round it to bf16 as the
        # reference's weight is)
        w = w * block_scale(s_rows, n_ok, k0, stride_sk, SCALE_E8M0)[:, None]
        if ROUND_W:
            w = bf16_rne(w)
        acc3 += x[:, None, :] * w[None, :, :]
    acc = tl.sum(acc3, axis=2)  # [BLOCK_T, BLOCK_N]
    if ROUND_OUT:  # the interpreter truncates on the cast; the GPU rounds
        acc = bf16_rne(acc)
    store_tile(out_ptr, acc, pid_s, t, t_ok, g, n, n_ok, stride_os, stride_ot,
                stride_og, False)  # fmt: skip


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
        acc = bf16_rne(acc)
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


GEMV_ROWS_LIMIT = 64  # BLOCK_T x BLOCK_N x BLOCK_K / VEC sums live in registers


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def gemv_config(rows: int, n: int, k: int, groups: int, device: torch.device) -> dict:
    """Tiles and K split of the GEMV; BLOCK_T covers the rows. One row (`_fp8_gemv_kernel`):
    16 weight bytes a thread per VEC group, 1024 columns a step (8 such loads in flight a
    thread; the H200 sweep's best), K split until the grid has ~2 programs per SM. 2+ rows
    (`_fp8_gemv_rows_kernel`, VEC 0): the first GEMV's tiles, ~4 programs per SM. (sm_90 builds
    checked with ptxas: no spills, no shuffles or shared memory inside the 1-row loop.)"""
    block_t = triton.next_power_of_2(max(rows, 1))
    on_gpu = device.type == "cuda"
    if block_t == 1:
        cfg = dict(BLOCK_N=16, BLOCK_K=1024, VEC=16, num_warps=4, num_stages=2, programs=2)
        if not on_gpu:  # interpreter: few, large programs
            cfg.update(BLOCK_N=8, BLOCK_K=64, num_stages=1)
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], max(cfg["VEC"], triton.next_power_of_2(k)))
    elif not on_gpu:
        cfg = dict(BLOCK_N=32, BLOCK_K=64, VEC=0, num_warps=4, num_stages=1, programs=0)
    else:  # 32 fp32 accumulators a thread at 2 warps
        block_n, block_k = (8, 128) if block_t <= 2 else (4, 64) if block_t <= 4 else (4, 32)
        cfg = dict(BLOCK_N=block_n, BLOCK_K=block_k, VEC=0, num_warps=2, num_stages=3,
                   programs=4)  # fmt: skip
    programs = cfg.pop("programs")
    cfg["BLOCK_T"] = block_t
    if not on_gpu:
        return {**cfg, "splits": 1}
    tiles = triton.cdiv(n, cfg["BLOCK_N"]) * groups
    sms = num_sms(device.index if device.index is not None else torch.cuda.current_device())
    steps = triton.cdiv(k, cfg["BLOCK_K"])
    splits = min(triton.cdiv(programs * sms, tiles), steps if cfg["VEC"] else max(1, steps // 2))
    return {**cfg, "splits": max(1, splits)}


def launch_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, y: torch.Tensor,
                cfg: dict) -> None:  # fmt: skip
    """y [T, G, N] = x [T, G, K] @ W^T per group; `cfg` from `gemv_config` (plus overrides)."""
    rows, groups, k = x.shape
    n = weight.shape[0] // groups
    assert rows <= GEMV_ROWS_LIMIT, f"a GEMV of {rows} rows: the [T, N, K] tile would not fit"
    cfg = dict(cfg)
    vec = cfg.pop("VEC")  # 0: the 2+ row kernel, one scale block a K step
    if vec:
        assert 128 % vec == 0 and cfg["BLOCK_K"] % vec == 0, "a VEC group in one scale block"
    else:
        assert 128 % cfg["BLOCK_K"] == 0, "a K step must sit in one scale block"
    split_len, splits = split_k(k, cfg["BLOCK_K"], cfg.pop("splits"))
    s, e8m0 = scale_operand(scale)
    out = split_output(y, splits)
    round_bf16 = x.dtype == torch.bfloat16
    on_gpu = x.is_cuda
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), splits, groups)
    args = (x, weight, s, out, rows, n, k, split_len,
            x.stride(0), x.stride(1), weight.stride(0), s.stride(0), s.stride(1),
            out.stride(0) if splits > 1 else 0, out.stride(-3), out.stride(-2))  # fmt: skip
    flags = dict(SCALE_E8M0=e8m0, ROUND_W=round_bf16 and not e8m0,
                 ROUND_OUT=round_bf16 and splits == 1 and not on_gpu)  # fmt: skip
    if vec:
        _fp8_gemv_kernel[grid](*args, PER_ELEMENT=not e8m0, VEC=vec, **flags, **cfg)
    else:
        _fp8_gemv_rows_kernel[grid](*args, **flags, **cfg)
    reduce_splits(out, y, round_bf16 and not on_gpu)
