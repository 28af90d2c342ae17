"""FP8 block-scaled weights dequantised to the activation dtype in one pass
(docs/model.md#fp8-linears).

`fp8_dequantize` writes e4m3 [N, K] x its 128x128 block scales as [N, K] bf16 (or fp32): the
values `dsv4.ops.quant.fp8_block_dequantize` computes (exact for UE8M0 scales; fp32 scales
round the fp32 product once to nearest even), at 3 bytes of traffic per bf16 element where the
torch ops take ~6 fp32 passes. fp8_linear serves prefill-sized products as this, then cuBLAS.
The linear kernels' shared jit helpers (scales, row pointers, output store) are in
kernels/jit_helpers.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.jit_helpers import bf16_rne, block_scale


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
    scale = block_scale(s_ptr + (n // 128).to(tl.int64) * stride_sn, n_ok, k0, stride_sk,
                         SCALE_E8M0)  # fmt: skip
    w = b.to(tl.float32) * scale[:, None]
    if ROUND:  # the interpreter truncates on the cast; the GPU rounds to nearest even
        w = bf16_rne(w)
    if not UPCAST:
        w = w.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + n.to(tl.int64)[:, None] * stride_on + kk[None, :], w, mask=ok)


def scale_operand(scale: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The block scales as the kernels read them (UE8M0 as its bytes, else fp32) and whether
    they are UE8M0 (`block_scale`'s SCALE_E8M0)."""
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
