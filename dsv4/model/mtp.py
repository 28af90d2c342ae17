"""The multi-token-prediction layer `mtp.0` (docs/model.md#mtp).

At target position i, with X_prev [M, D] the main model's final stream state at i (after the
last block, before hc_head) and e = Embed(token_{i+1}):
    X0_m = e_proj(enorm(e)) + h_proj(hnorm(X_prev_m))      (e_proj broadcast to all streams)
    X1   = Block_mtp(X0)                                   (layer id L, ratio cfg.mtp_compress_ratio)
    logits(token_{i+2}) = head(norm(hc_head_mtp(X1)))
Embedding and head are the main model's (passed in, not owned: no `mtp.0.embed*` tensors).
The block is never a hash layer (layer id L >= num_hash_layers). We do not zero the embedding
at position 0 as vLLM does; that is not part of the equations above.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.config.model import ModelConfig
from dsv4.model.block import Block
from dsv4.model.layers import RMSNorm, linear
from dsv4.model.state import LayerState
from dsv4.ops.hyper import hc_head


class MTPLayer(Block):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, cfg.num_hidden_layers)
        d, m = cfg.hidden_size, cfg.hc_mult
        self.e_proj = linear(d, d)
        self.h_proj = linear(d, d)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(m, m * d))
        self.hc_head_base = nn.Parameter(torch.zeros(m))
        self.hc_head_scale = nn.Parameter(torch.ones(1))

    def draft(
        self,
        streams: torch.Tensor,
        next_embed: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        states: list[LayerState] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [B, S, M, D], next_embed [B, S, D] (embedding of token i+1), next_ids [B, S]
        -> (X1 [B, S, M, D], normed hidden [B, S, D] to feed the shared head)."""
        e = self.e_proj(self.enorm(next_embed))  # [B, S, D]
        h = self.h_proj(self.hnorm(streams))  # [B, S, M, D]
        x0 = h + e.unsqueeze(-2)
        x1 = self.forward(x0, next_ids, positions, states)
        cfg = self.cfg
        collapsed = hc_head(
            x1, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, cfg.hc_eps, cfg.rms_norm_eps
        )
        return x1, self.norm(collapsed)
