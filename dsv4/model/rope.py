"""Interleaved ("GPT-J") rotary embedding on the trailing rope slice
(docs/model.md#rope-and-yarn).

Pairs (2j, 2j+1) of the last `rope_dim` channels rotate by angle p * f_j, f_j = base^(-2j/rope_dim).
- ratio-0 (sliding-window only) layers and the MTP layer: base = rope_theta, no YaRN;
- compressed layers (ratio 4/128), their compressors and the indexer: base =
  compress_rope_theta with YaRN frequency interpolation and no mscale.
This matches transformers 5.23 (`rope_parameters["main"]` / `["compress"]`, attention_factor 1).
The inverse rotation (angle -p * f_j) undoes the rope on the attention output.
"""

from __future__ import annotations

import functools
import math

import torch

from dsv4.model.config import ModelConfig, YarnScaling


@functools.lru_cache(maxsize=16)
def _inv_freq_cpu(rope_dim: int, base: float, yarn: YarnScaling | None) -> torch.Tensor:
    half = rope_dim // 2
    freq = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))  # [half]
    if yarn is None:
        return freq

    def correction_dim(num_rotations: float) -> float:
        # The dimension index whose wavelength fits `num_rotations` times in the original length.
        orig = yarn.original_max_position_embeddings
        return rope_dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(half, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # ramp 0 (high frequencies) keeps f_j; ramp 1 (low frequencies) interpolates f_j / factor.
    return freq / yarn.factor * ramp + freq * (1 - ramp)


def inv_freq(cfg: ModelConfig, ratio: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[rope_dim / 2] fp32 frequencies for a layer (or its compressor/indexer) of `ratio`.
    Cached per device: a host->device copy per call could not be captured in a CUDA graph."""
    if ratio == 0:
        return _inv_freq_on(cfg.qk_rope_head_dim, float(cfg.rope_theta), None, str(device))
    return _inv_freq_on(cfg.qk_rope_head_dim, float(cfg.compress_rope_theta), cfg.rope_scaling,
                        str(device))  # fmt: skip


@functools.lru_cache(maxsize=64)
def _inv_freq_on(rope_dim: int, base: float, yarn: YarnScaling | None, device: str) -> torch.Tensor:
    return _inv_freq_cpu(rope_dim, base, yarn).to(device)


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
