"""The compressor's per-channel window softmax (docs/model.md#compressor): the reference of the
model's `Compressor` (dsv4/model/compressor.py) and of kernels/compressor.py."""

from __future__ import annotations

import torch


def compress_windows(
    kv: torch.Tensor,
    gate: torch.Tensor,
    overlap_kv: torch.Tensor | None,
    overlap_gate: torch.Tensor | None,
    overlapping: bool,
) -> torch.Tensor:
    """kv, gate [n, r, c*d'] fp32 (gate includes ape) -> entries [n, d'] fp32.

    `overlapping` (ratio 4): window 0 also softmaxes over `overlap_*` [r, d'] (the first halves
    of the window before this batch of windows), or over nothing when they are None.
    """
    if not overlapping:
        return (gate.softmax(dim=1) * kv).sum(dim=1)
    _, r, width = kv.shape
    d = width // 2
    if overlap_kv is None:
        overlap_kv = kv.new_zeros(1, r, d)
        overlap_gate = gate.new_full((1, r, d), float("-inf"))
    prev_kv = torch.cat((overlap_kv.view(1, r, d), kv[:-1, :, :d]), dim=0)  # [n, r, d]
    prev_gate = torch.cat((overlap_gate.view(1, r, d), gate[:-1, :, :d]), dim=0)
    cand_kv = torch.cat((prev_kv, kv[..., d:]), dim=1)  # [n, 2r, d]
    cand_gate = torch.cat((prev_gate, gate[..., d:]), dim=1)
    return (cand_gate.softmax(dim=1) * cand_kv).sum(dim=1)
