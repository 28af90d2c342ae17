"""Interleaved ("GPT-J") rotary embedding on the trailing rope slice (docs/model.md#rope-and-yarn):
pairs (2j, 2j+1) of the last rope_dim channels rotate by angle p * f_j. The frequencies f_j of
a layer come from its config (`dsv4.model.rope.inv_freq`); these are the rotation itself, the
reference of kernels/norm_rope.py.
"""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] int -> (cos, sin) [..., rope_dim / 2] fp32."""
    angles = positions.to(torch.float32).unsqueeze(-1) * freq
    return angles.cos(), angles.sin()


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Rotate the last 2*cos.shape[-1] channels of x [T, ..., D] by (cos, sin) [T, D_r/2].

    Middle dims of x (heads) broadcast. `inverse=True` rotates by the negative angle.
    """
    half = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        sin = -sin
    nope, rope = x[..., : -2 * half], x[..., -2 * half :]
    pairs = rope.float().unflatten(-1, (half, 2))  # [..., half, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)
