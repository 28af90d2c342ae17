"""Lightning indexer of the ratio-4 layers (docs/model.md#lightning-indexer).

score(p, i) = sum_h w_h(p) * ReLU(q_h(p) . k_i),  w = weights_proj(x) * d_I^-1/2 * H_I^-1/2,
over the indexer's own compressed keys k_i (a ratio-4 `Compressor` with d' = index_head_dim);
entries i >= floor((p + 1) / 4) are not yet available. Each query keeps the top
`index_topk` available entries (local entry indices, -1 padded).

NOTE: ties are broken towards the lower entry index (stable sort), so the selection does
not depend on how many entries exist beyond the query, i.e. on the chunking. ReLU makes
exact ties (score 0) common; `torch.topk` breaks them shape-dependently
(docs/architecture.md#platform-notes).
We keep the reference's numerics otherwise: no Hadamard rotation and no FP4 simulation of
q and k (transformers does neither; docs/model.md#choices-where-implementations-differ).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.config.model import ModelConfig
from dsv4.model.compressor import Compressor
from dsv4.model.hot_ops import REFERENCE_OPS, HotOps
from dsv4.model.layers import linear
from dsv4.model.state import CompressorState
from dsv4.ops.rope import apply_rope

# #49486: when every query's available entries fit in top-k, the top-k is "all of them": skip
# the q projection, scores and top-k (the compressor still runs: it fills the keys).
SKIP_TOPK_WHEN_ALL_FIT = True


def set_skip_topk(enabled: bool) -> None:
    """Switch the #49486 skip (on by default; outputs are identical either way)."""
    global SKIP_TOPK_WHEN_ALL_FIT
    SKIP_TOPK_WHEN_ALL_FIT = enabled


def all_available(positions: torch.Tensor, num_entries: int, ratio: int) -> torch.Tensor:
    """positions [S] -> [S, num_entries]: row p holds 0..(p+1)//ratio - 1, then -1 (the
    same index set `indexer_topk` returns when they all fit in top-k)."""
    idx = torch.arange(num_entries, device=positions.device)
    return torch.where(idx < ((positions + 1) // ratio).unsqueeze(-1), idx, -1)


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.wq_b = linear(cfg.q_lora_rank, self.num_heads * self.head_dim)
        self.weights_proj = linear(cfg.hidden_size, self.num_heads)
        self.compressor = Compressor(cfg, 4, self.head_dim)
        self.ops: HotOps = REFERENCE_OPS  # indexer_scores / _topk (DeepseekV4.use_hot_ops)

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        state: CompressorState | None,
    ) -> torch.Tensor:
        """One sequence: x [S, D], qr [S, q_lora], positions [S] (contiguous), cos/sin of the
        compressed-layer rope at `positions` -> top-k entry indices [S, k] (-1 padded)."""
        keys = self.compressor(x, int(positions[0]), state)  # [N, d_I]
        if SKIP_TOPK_WHEN_ALL_FIT and keys.shape[0] <= self.cfg.index_topk:
            return all_available(positions, keys.shape[0], 4)
        q = self.wq_b(qr).view(x.shape[0], self.num_heads, self.head_dim)
        q = apply_rope(q, cos, sin)  # [S, H_I, d_I]
        scale = (self.head_dim * self.num_heads) ** -0.5
        weights = self.weights_proj(x).float() * scale  # [S, H_I]
        scores = self.ops.indexer_scores(q, keys, weights)
        return self.ops.indexer_topk(scores, positions, 4, self.cfg.index_topk)
