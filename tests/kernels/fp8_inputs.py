"""Seeded inputs of the FP8 linear tests: block-quantized weights and activations, on the GPU
when there is one."""

from __future__ import annotations

import torch

from dsv4.ops.quant import fp8_block_quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fp8_weight(n: int, k: int, seed: int, scale_dtype=torch.float8_e8m0fnu):
    """(e4m3 codes [n, k], 128x128 block scales): UE8M0 as checkpoints store them, or fp32
    scales off the powers of two (scale_dtype float32) to exercise the general path."""
    g = torch.Generator(DEVICE).manual_seed(seed)
    codes, scale = fp8_block_quantize(torch.randn(n, k, generator=g, device=DEVICE) / k**0.5)
    if scale_dtype == torch.float32:
        scale = scale.float() * (1 + torch.rand(scale.shape, generator=g, device=DEVICE))
    return codes, scale


def activations(shape, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator(DEVICE).manual_seed(seed)
    return torch.randn(shape, generator=g, device=DEVICE).to(dtype)
