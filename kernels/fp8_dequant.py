"""FP8 block-scaled weights dequantised to the activation dtype in one pass
(docs/model.md#fp8-linears).

`fp8_dequantize` writes e4m3 [N, K] x its 128x128 block scales as [N, K] bf16 (or fp32): the
values `dsv4.model.quant.fp8_block_dequantize` computes (exact for UE8M0 scales; fp32 scales
round the fp32 product once to nearest even), at 3 bytes of traffic per bf16 element where the
torch ops take ~6 fp32 passes. fp8_linear serves prefill-sized products as this, then cuBLAS.
`_block_scale` reads one K step's scales for a row tile; `_weight_rows` and `_store_tile` are
the linear kernels' shared row pointers and output store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.compressor import _bf16_rne


@triton.jit
def _scales_at(ptrs, mask, SCALE_E8M0: tl.constexpr):
    """fp32 block scales at `ptrs` (any shape): UE8M0 bytes as 2^(b - 127), else fp32 as stored."""
    # one return: Triton 3.6 type-checks every return of a jit function, constexpr-dead or not
    if SCALE_E8M0:
        sb = tl.load(ptrs, mask=mask, other=127).to(tl.int32) & 0xFF
        # byte 0 is 2^-127, an fp32 subnormal (0 << 23 would read as zero)
        scale = tl.where(sb == 0, 5.877471754111438e-39, (sb << 23).to(tl.float32, bitcast=True))
    else:
        scale = tl.load(ptrs, mask=mask, other=1.0)
    return scale


@triton.jit
def _block_scale(s_rows, n_ok, k0, stride_sk, SCALE_E8M0: tl.constexpr):
    """The [BLOCK_N] fp32 scales of weight rows `s_rows` (pointers) at K step k0."""
    return _scales_at(s_rows + (k0 // 128) * stride_sk, n_ok, SCALE_E8M0)


@triton.jit
def _weight_rows(w_ptr, s_ptr, g, N, n, stride_wn, stride_sn):
    """Pointers to the weight rows and scale rows of output features `n` [BLOCK_N] of group g
    (the global weight row g * N + n; its scale row that // 128)."""
    w_row = (g * N + n).to(tl.int64)
    return w_ptr + w_row * stride_wn, s_ptr + (w_row // 128) * stride_sn


@triton.jit
def _store_tile(out_ptr, acc, pid_s, rows, row_ok, g, n, n_ok, stride_os, stride_ot, stride_og,
                TRANSPOSED: tl.constexpr):  # fmt: skip
    """Store acc [rows, n] (TRANSPOSED: [n, rows]) at out [split pid_s, row, group g, n]."""
    out_rows = (out_ptr + pid_s.to(tl.int64) * stride_os + rows.to(tl.int64) * stride_ot
                + g * stride_og)  # fmt: skip
    if TRANSPOSED:  # the transposed tile through transposed pointers
        tl.store(out_rows[None, :] + n[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=n_ok[:, None] & row_ok[None, :])  # fmt: skip
    else:
        tl.store(out_rows[:, None] + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])  # fmt: skip


@triton.jit
def _fp8_dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_sk, stride_on,
                        SCALE_E8M0: tl.constexpr, ROUND: tl.constexpr, UPCAST: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """out [N, K] (x's dtype) = e4m3 w [N, K] x its block scale: fp32 product, one rounding."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    kk = k0 + tl.arange(0, BLOCK_K)
    n_ok, ok = n < N, (n < N)[:, None] & (kk < K)[None, :]
    b = tl.load(w_ptr + n.to(tl.int64)[:, None] * stride_wn + kk[None, :], mask=ok, other=0.0)
    scale = _block_scale(s_ptr + (n // 128).to(tl.int64) * stride_sn, n_ok, k0, stride_sk,
                         SCALE_E8M0)  # fmt: skip
    w = b.to(tl.float32) * scale[:, None]
    if ROUND:  # the interpreter truncates on the cast; the GPU rounds to nearest even
        w = _bf16_rne(w)
    if not UPCAST:
        w = w.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + n.to(tl.int64)[:, None] * stride_on + kk[None, :], w, mask=ok)


def scale_operand(scale: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The block scales as the kernels read them (UE8M0 as its bytes, else fp32) and whether
    they are UE8M0 (`_block_scale`'s SCALE_E8M0)."""
    e8m0 = scale.dtype == torch.float8_e8m0fnu
    return (scale.view(torch.uint8) if e8m0 else scale.float()), e8m0


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 weight [N, K] x block scales -> [N, K] in `dtype`, in one pass (3 bytes of traffic
    per bf16 element; `fp8_block_dequantize`'s torch ops take ~6 fp32 passes)."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    s, e8m0 = scale_operand(scale)
    block_k = 128  # one scale column per program
    on_gpu = weight.is_cuda
    _fp8_dequant_kernel[(triton.cdiv(n, 32), triton.cdiv(k, block_k))](
        weight, s, out, n, k, weight.stride(0), s.stride(0), s.stride(1), out.stride(0),
        SCALE_E8M0=e8m0, ROUND=dtype == torch.bfloat16 and not on_gpu, UPCAST=not on_gpu,
        BLOCK_N=32, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return out
