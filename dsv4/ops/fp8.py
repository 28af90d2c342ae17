"""FP8 linear references (docs/model.md#fp8-linears): x through a weight stored as e4m3 with one
scale per 128x128 block, dequantised first, with exact (bf16) or W8A8 (e4m3 per 1x128 group)
activations. The references of kernels/fp8_linear.py and kernels/fp8_w8a8.py and the math of
the model's `FP8Linear` (dsv4/model/fp8.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4.ops.quant import fp8_block_dequantize

FP8_BLOCK = 128  # the served scale block (the kernel's BLOCK_K divides it)
FP8_MAX = 448.0  # the largest finite e4m3 value
AMAX_FLOOR = 1e-4  # an all-zero group still gets a finite scale (DeepGEMM's clamp)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 [..., K], fp32 scales [..., ceil(K/128)]): one scale per 1x128 group,
    max(amax, 1e-4) / 448 (DeepGEMM's `per_token_cast_to_fp8`)."""
    k = x.shape[-1]
    xf = F.pad(x.float(), (0, (-k) % FP8_BLOCK)).unflatten(-1, (-1, FP8_BLOCK))
    s = xf.abs().amax(-1).clamp_min(AMAX_FLOOR) / FP8_MAX
    q = (xf / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2)[..., :k], s


def w8a8_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> the values a W8A8 product multiplies, in fp32: e4m3 codes x group scale."""
    q, s = quantize_activations(x)
    k = x.shape[-1]
    xd = F.pad(q.float(), (0, (-k) % FP8_BLOCK)).unflatten(-1, (-1, FP8_BLOCK))
    return (xd * s[..., None]).flatten(-2)[..., :k]


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               activations: str = "bf16") -> torch.Tensor:  # fmt: skip
    """x [..., K] @ W^T -> [..., N] in x.dtype; W = weight [N, K] e4m3 x scale [ceil(N/128),
    ceil(K/128)] (UE8M0 or fp32), dequantised to x.dtype first (exact for UE8M0 in bf16).
    `activations` "fp8" (W8A8): x rounded per 1x128 group to e4m3 first, the product in fp32."""
    if activations == "fp8":
        w = fp8_block_dequantize(weight, scale, FP8_BLOCK, torch.float32)
        return F.linear(w8a8_activations(x), w).to(x.dtype)
    return F.linear(x, fp8_block_dequantize(weight, scale, FP8_BLOCK, x.dtype))


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       activations: str = "bf16") -> torch.Tensor:  # fmt: skip
    """x [..., G, K] -> [..., G, N]: group g through rows [g*N, (g+1)*N) of W = weight [G*N, K]
    e4m3 x scale (the grouped output projection, docs/model.md#grouped-output-projection);
    `activations` as above."""
    groups, k = x.shape[-2:]
    if activations == "fp8":
        w = fp8_block_dequantize(weight, scale, FP8_BLOCK, torch.float32).view(groups, -1, k)
        return torch.einsum("...gk,gok->...go", w8a8_activations(x), w).to(x.dtype)
    w = fp8_block_dequantize(weight, scale, FP8_BLOCK, x.dtype).view(groups, -1, k)  # [G, N, K]
    return torch.einsum("...gk,gok->...go", x, w)
