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

from dsv4.config.model import ModelConfig, YarnScaling


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
