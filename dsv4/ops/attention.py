"""Sparse attention with a per-head sink (docs/model.md#attention-with-sink): the reference of
kernels/sparse_attention.py and of the model's attention (dsv4/model/attention.py)."""

from __future__ import annotations

import torch


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    visible: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [S, H, d], kv [L, d] (key = value), visible [S, L] bool, sink [H] -> o [S, H, d] fp32.

    o_h = sum_j e^{l_j} kv_j / (sum_j e^{l_j} + e^{sink_h}), l_j = scale * q_h . kv_j over the
    visible j (docs/model.md#attention-with-sink).
    """
    logits = torch.einsum("shd,ld->hsl", q.float(), kv.float()) * scale  # [H, S, L]
    logits = logits.masked_fill(~visible, float("-inf"))
    sinks = sink.float().view(-1, 1, 1).expand(-1, q.shape[0], 1)  # [H, S, 1]
    probs = torch.cat((logits, sinks), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("hsl,ld->shd", probs, kv.float())
