"""Small building blocks shared by the model files.

Norms follow docs/model.md#norms (the math is `dsv4.ops.norm.rms_norm`).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.ops.norm import rms_norm


class RMSNorm(nn.Module):
    """Weighted RMSNorm; the parameter is `weight` so state_dict keys read `<name>.weight`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def linear(in_features: int, out_features: int) -> nn.Linear:
    """Bias-free linear (every DeepSeek-V4 projection is bias-free)."""
    return nn.Linear(in_features, out_features, bias=False)


# Half-precision inputs whose products are exact in fp32 (8 or 11 mantissa bits each, 24 kept)
_EXACT_PRODUCT_DTYPES = (torch.bfloat16, torch.float16)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T computed in fp32 -> [..., N] fp32 (compressor and router
    math, docs/model.md#norms).

    On CUDA with bf16 (or fp16) x and weight it is one tensor-core GEMM with fp32 output: every
    product of two such values is exact in fp32, so the result differs from upcasting first
    only in the order the fp32 sum is taken, and no fp32 copy of the weight (4 bytes an element,
    a SIMT GEMM at ~5% of the tensor cores' rate) is made or read."""
    if x.is_cuda and x.dtype == weight.dtype and x.dtype in _EXACT_PRODUCT_DTYPES:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.mm(flat, weight.t(), out_dtype=torch.float32)  # [rows, N]
        return out.view(*x.shape[:-1], weight.shape[0])
    return torch.nn.functional.linear(x.float(), weight.float())
