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


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T computed in fp32 (compressor and router math, docs/model.md#norms)."""
    return torch.nn.functional.linear(x.float(), weight.float())
