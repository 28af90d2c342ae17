"""FP8 block-scaled linears, weight-only (DSV4_ARCH.md §7): y = x @ W^T, W = e4m3 x scale.

W [N, K] float8_e4m3fn carries one scale per 128x128 block, `scale` [ceil(N/128), ceil(K/128)]
(UE8M0 float8_e8m0fnu in V4 checkpoints, fp32 in -Base ones). Each weight tile is dequantised
in registers right after its load: an fp32 multiply by its block's scale, one cast to x's dtype
(exact for e4m3 x 2^k in bf16), then the MMA with fp32 accumulation. That is the math of
`fp8_linear_ref` (dequantise the weight, then F.linear) up to summation order. BLOCK_K divides
128, so every K step reads one scale column.

One kernel covers both regimes:
- decode (T <= 64 rows): a weight-streaming GEMV. With N 512-1024 and K 4096 (wkv, wq_a) the
  output tiles alone would occupy a few of the H200's 132 SMs, so K is split across S programs
  per tile: each stores its fp32 partial sums [S, T, G, N] and `_fp8_linear_reduce_kernel`
  adds them in split order, then casts. Deterministic (no atomics): for a given shape the
  result does not depend on timing. S and the tiles are functions of (T, N, K, G) only.
- prefill (T in the thousands): a tiled GEMM, grouped tile order for L2 reuse; split only when
  the tiles leave most SMs idle and the partials stay small next to the weights.
`fp8_grouped_linear` is the same kernel with a group grid axis: attn.wo_a's grouped output
projection, z[:, g] = o[:, g] @ W[g*N:(g+1)*N]^T, in one launch (scale rows follow the global
weight row, so a group need not start on a 128-row block).

No host sync and no data-dependent allocation: CUDA-graph capturable. The configs below are
first choices, not tuned on an H200 yet (`tune` overrides them: a benchmark sweep).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dsv4.model import fp8 as model_fp8
from kernels.compressor import _bf16_rne
from kernels.moe import _tile_ids  # grouped tile order: row tiles sweep W's columns together
from kernels.registry import register_op
from kernels.specialize import sizes_vary

FP8_BLOCK = model_fp8.FP8_BLOCK
# POST_SCALE: cast the e4m3 tile straight to bf16 and multiply the dot's [BLOCK_M, BLOCK_N] sums
# by the block scale, instead of scaling every [BLOCK_K, BLOCK_N] weight element in fp32 before
# the cast (BLOCK_K / BLOCK_M times fewer ALU ops in front of the MMA at decode sizes; the same
# products, the sum split at K-step boundaries). Off until timed on a GPU (`tune`).
POST_SCALE_DEFAULT = False


@triton.jit
def _block_scale(s_rows, n_ok, k0, stride_sk, SCALE_E8M0: tl.constexpr):
    """The [BLOCK_N] fp32 scales of weight rows `s_rows` (pointers) at K step k0."""
    # one return: Triton 3.6 type-checks every return of a jit function, constexpr-dead or not
    if SCALE_E8M0:
        sb = tl.load(s_rows + (k0 // 128) * stride_sk, mask=n_ok, other=127).to(tl.int32) & 0xFF
        # byte 0 is 2^-127, an fp32 subnormal (0 << 23 would read as zero)
        scale = tl.where(sb == 0, 5.877471754111438e-39, (sb << 23).to(tl.float32, bitcast=True))
    else:
        scale = tl.load(s_rows + (k0 // 128) * stride_sk, mask=n_ok, other=1.0)
    return scale


@triton.jit(**sizes_vary("T", "split_len"))
def _fp8_linear_kernel(
    # Pointers: x [T, G, K] (K contiguous), w [G*N, K] e4m3, scales [ceil(G*N/128), ceil(K/128)];
    # out: y [T, G, N] in x's dtype (one split) or fp32 partials [S, T, G, N]
    x_ptr, w_ptr, s_ptr, out_ptr,
    # Sizes (T rows per step; N, K fixed by the layer), strides (elements)
    T, N, K, split_len,
    stride_xt, stride_xg, stride_wn, stride_sn, stride_sk, stride_os, stride_ot, stride_og,
    # Meta-parameters
    SCALE_E8M0: tl.constexpr, ROUND_W: tl.constexpr, ROUND_OUT: tl.constexpr, UPCAST: tl.constexpr,
    POST_SCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _tile_ids(tl.cdiv(T, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    pid_s, g = tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_row = (g * N + n).to(tl.int64)  # the global weight row (and its scale row)
    x_rows = x_ptr + rows.to(tl.int64) * stride_xt + g * stride_xg
    w_rows = w_ptr + w_row * stride_wn
    s_rows = s_ptr + (w_row // 128) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = pid_s * split_len
    for k0 in range(k_lo, tl.minimum(K, k_lo + split_len), BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(x_rows[:, None] + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_rows[None, :] + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        scale = _block_scale(s_rows, n_ok, k0, stride_sk, SCALE_E8M0)  # [BLOCK_N]
        if UPCAST:  # the interpreter computes on raw bf16 bits otherwise
            a = a.to(tl.float32)
        if POST_SCALE:  # e4m3 -> x's dtype (exact), the power-of-two scale on the step's sums
            w = b.to(tl.float32) if UPCAST else b.to(x_ptr.dtype.element_ty)
            acc += tl.dot(a, w, input_precision=DOT_PRECISION) * scale[None, :]
        else:
            w = b.to(tl.float32) * scale[None, :]
            if UPCAST and ROUND_W:  # the reference's dequantised bf16 weight (rounds fp32 scales)
                w = _bf16_rne(w)
            elif not UPCAST:
                w = w.to(x_ptr.dtype.element_ty)  # [BLOCK_K, BLOCK_N]
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if ROUND_OUT:  # the interpreter truncates on the cast; the GPU rounds
        acc = _bf16_rne(acc)
    out_at = (out_ptr + pid_s.to(tl.int64) * stride_os + rows.to(tl.int64)[:, None] * stride_ot
              + g * stride_og)  # fmt: skip
    tl.store(out_at + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])  # fmt: skip


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


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _config(rows: int, n: int, k: int, groups: int, device: torch.device) -> dict:
    """Tiles and the K split for a [rows, K] x [N, K]^T product per group."""
    if device.type != "cuda":  # interpreter: few, large programs
        return dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=1,
                    splits=1)  # fmt: skip
    if rows <= 64:  # decode: stream the weight, one row tile, fill the SMs by splitting K
        cfg = dict(BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=64, BLOCK_K=128,
                   GROUP_M=1, num_warps=4, num_stages=4)  # fmt: skip
    elif rows <= 256:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    tiles = triton.cdiv(rows, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]) * groups
    steps = triton.cdiv(k, cfg["BLOCK_K"])
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    # >= 2 K steps per split; partials (S x rows x N fp32) at most ~4x the weight's bytes
    splits = min(triton.cdiv(2 * sms, tiles), max(1, steps // 2), max(1, k // rows))
    return {**cfg, "splits": max(1, splits)}


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, tune: dict | None):
    """x [T, G, K] (K contiguous) -> y [T, G, N] in x's dtype."""
    rows, groups, k = x.shape
    n = weight.shape[0] // groups
    assert x.dtype in (torch.bfloat16, torch.float32) and x.stride(2) == 1, (x.dtype, x.stride())
    assert weight.dtype == torch.float8_e4m3fn and weight.shape == (groups * n, k)
    assert weight.stride(1) == 1
    assert scale.shape == (triton.cdiv(groups * n, FP8_BLOCK), triton.cdiv(k, FP8_BLOCK))
    y = torch.empty(rows, groups, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    cfg = {**_config(rows, n, k, groups, x.device), **(tune or {})}
    assert FP8_BLOCK % cfg["BLOCK_K"] == 0, "a K step must sit in one scale block"
    steps = triton.cdiv(k, cfg["BLOCK_K"])
    per_split = triton.cdiv(steps, cfg.pop("splits"))
    splits = triton.cdiv(steps, per_split)
    e8m0 = scale.dtype == torch.float8_e8m0fnu
    # the scale on the dot's sums is exact only for power-of-two (UE8M0) scales
    post_scale = bool(cfg.pop("POST_SCALE", POST_SCALE_DEFAULT)) and e8m0
    s = scale.view(torch.uint8) if e8m0 else scale.float()
    out = y if splits == 1 else torch.empty(splits, rows, groups, n, dtype=torch.float32,
                                            device=x.device)  # fmt: skip
    os = out.stride(0) if splits > 1 else 0
    on_gpu = x.is_cuda
    round_bf16 = x.dtype == torch.bfloat16 and not on_gpu
    grid = (triton.cdiv(rows, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), splits, groups)
    _fp8_linear_kernel[grid](
        x, weight, s, out,
        rows, n, k, per_split * cfg["BLOCK_K"],
        x.stride(0), x.stride(1), weight.stride(0), s.stride(0), s.stride(1),
        os, out.stride(-3), out.stride(-2),
        SCALE_E8M0=e8m0, ROUND_W=round_bf16, ROUND_OUT=round_bf16 and splits == 1, UPCAST=not on_gpu,
        POST_SCALE=post_scale, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **cfg,
    )  # fmt: skip
    if splits > 1:
        total, block = rows * groups * n, 1024
        _fp8_linear_reduce_kernel[(triton.cdiv(total, block),)](
            out, y, total, splits, ROUND_BF16=round_bf16, BLOCK=block)  # fmt: skip
    return y


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *,
               tune: dict | None = None) -> torch.Tensor:  # fmt: skip
    """x [..., K] bf16 (or fp32) @ W^T -> [..., N] in x.dtype; W = weight [N, K] e4m3 x scale
    [ceil(N/128), ceil(K/128)] (UE8M0 or fp32). `tune`: config overrides (BLOCK_M/N/K,
    GROUP_M, num_warps, num_stages, splits, POST_SCALE)."""
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, 1, k)
    if flat.stride(2) != 1:
        flat = flat.contiguous()
    return _launch(flat, weight, scale, tune).view(*lead, weight.shape[0])


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *,
                       tune: dict | None = None) -> torch.Tensor:  # fmt: skip
    """x [..., G, K] -> [..., G, N]: group g through rows [g*N, (g+1)*N) of W = weight [G*N, K]
    e4m3 x scale, one launch (attn.wo_a)."""
    lead, (groups, k) = x.shape[:-2], x.shape[-2:]
    flat = x.reshape(-1, groups, k)
    if flat.stride(2) != 1:
        flat = flat.contiguous()
    return _launch(flat, weight, scale, tune).view(*lead, groups, weight.shape[0] // groups)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Reference (and slow path): the model's op, dequantise the whole weight then F.linear."""
    return model_fp8.fp8_linear.reference(x, weight, scale)


def fp8_grouped_linear_ref(x: torch.Tensor, weight: torch.Tensor,
                           scale: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Reference: the model's op, dequantise the whole weight then one einsum over groups."""
    return model_fp8.fp8_grouped_linear.reference(x, weight, scale)


register_op("fp8_linear", fp8_linear, fp8_linear_ref, family="fp8_linear")
register_op("fp8_grouped_linear", fp8_grouped_linear, fp8_grouped_linear_ref,
            family="fp8_linear")  # fmt: skip
