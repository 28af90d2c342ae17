"""RMSNorm (docs/model.md#norms): statistics in fp32, the weight applied in fp32, one cast back.
The reference of the model's `RMSNorm` and of kernels/norm_rope.py."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim; fp32 math, output in x.dtype."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype)
