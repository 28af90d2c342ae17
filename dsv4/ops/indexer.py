"""Lightning indexer scores and top-k (docs/model.md#lightning-indexer): the references of the
model's indexer (dsv4/model/indexer.py) and of kernels/indexer.py, kernels/indexer_select.py.

NOTE: ties are broken towards the lower entry index (stable sort), so the selection does not
depend on how many entries exist beyond the query, i.e. on the chunking.
"""

from __future__ import annotations

import torch


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """q [S, H_I, d_I], keys [N, d_I], weights [S, H_I] (already scaled) -> [S, N] fp32."""
    dots = torch.einsum("shd,nd->shn", q.float(), keys.float()).relu()  # [S, H_I, N]
    return (dots * weights.float().unsqueeze(-1)).sum(dim=1)


def indexer_topk(
    scores: torch.Tensor, positions: torch.Tensor, ratio: int, topk: int
) -> torch.Tensor:
    """scores [S, N], positions [S] -> indices [S, min(topk, N)] int64, -1 = no entry.

    Entry i is available to the query at p iff i < (p + 1) // ratio.
    """
    n = scores.shape[-1]
    k = min(topk, n)
    available = torch.arange(n, device=scores.device) < ((positions + 1) // ratio).unsqueeze(-1)
    masked = scores.masked_fill(~available, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]  # [S, k]
    chosen_ok = available.gather(-1, order)
    return torch.where(chosen_ok, order, torch.full_like(order, -1))
