"""Mixture-of-experts references (docs/model.md#moe): the router and the SwiGLU expert, for the
model (dsv4/model/moe.py) and kernels/routing.py, kernels/moe.py.

Router: s = sqrt(softplus(g)); hash layers take experts = tid2eid[token id], scored layers the
top-k of s + bias (the bias only selects); weights are the unbiased s of the chosen experts,
renormalised, times routed_scaling_factor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    token_ids: torch.Tensor,
    tid2eid: torch.Tensor | None,
    top_k: int,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (weights [T, K] fp32, expert ids [T, K] int64).

    `tid2eid` [V, K] given: hash routing by token id; else top-k of scores + `bias`.
    """
    scores = F.softplus(logits).sqrt()  # [T, E]
    if tid2eid is not None:
        ids = tid2eid[token_ids].long()
    else:
        biased = scores if bias is None else scores + bias.float()
        ids = biased.topk(top_k, dim=-1).indices
    weights = scores.gather(-1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def swiglu(
    u: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, limit: float | None
) -> torch.Tensor:
    """w2(silu(min(w1 u, limit)) * clamp(w3 u, -limit, limit)); limit None = no clamp."""
    return F.linear(gated_silu(F.linear(u, w1), F.linear(u, w3), limit).to(u.dtype), w2)


def gated_silu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32."""
    gate, up = gate.float(), up.float()
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up
