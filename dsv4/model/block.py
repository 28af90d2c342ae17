"""One DeepSeek-V4 block (docs/model.md#forward): mHC around attention, then mHC around MoE.

u, post, comb = hc_pre(X; hc_attn_*);  X = hc_post(attn(attn_norm(u)), X, post, comb)
u, post, comb = hc_pre(X; hc_ffn_*);   X = hc_post(moe(ffn_norm(u)), X, post, comb)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dsv4.config.model import ModelConfig
from dsv4.model.attention import Attention
from dsv4.model.hot_ops import REFERENCE_OPS, HotOps
from dsv4.model.index_cache import TopkRelay
from dsv4.model.layers import RMSNorm
from dsv4.model.moe import MoE
from dsv4.model.state import LayerState
from dsv4.ops.hyper import hc_post_first, hc_pre_first

HcMix = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (u, post, comb)
HcPre = Callable[..., HcMix]  # (x, fn, scale, base, iters, eps, norm_eps) -> HcMix


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        d, m = cfg.hidden_size, cfg.hc_mult
        mix = (2 + m) * m
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hc_attn_fn = nn.Parameter(torch.zeros(mix, m * d))
        self.hc_attn_base = nn.Parameter(torch.zeros(mix))
        self.hc_attn_scale = nn.Parameter(torch.ones(3))
        self.hc_ffn_fn = nn.Parameter(torch.zeros(mix, m * d))
        self.hc_ffn_base = nn.Parameter(torch.zeros(mix))
        self.hc_ffn_scale = nn.Parameter(torch.ones(3))
        self.attn = Attention(cfg, layer_id)
        self.ffn = MoE(cfg, layer_id)
        self.ops: HotOps = REFERENCE_OPS  # hc_pre, hc_post (DeepseekV4.use_hot_ops)

    def forward(
        self,
        x: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        states: list[LayerState] | None,
        is_embedding: bool = False,
        topk_relay: TopkRelay | None = None,
    ) -> torch.Tensor:
        """x [B, S, M, D] streams, or the embedding [B, S, D] when `is_embedding` (first block:
        the M streams are identical copies, never materialised) -> [B, S, M, D].
        `topk_relay`: the forward's IndexCache top-k hand-off (dsv4.model.index_cache)."""
        if is_embedding:
            cfg = self.cfg
            attn_params = (self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
            u, post, comb = hc_pre_first(x, *attn_params, cfg.hc_mult, *self._hc_args)
            y = self.attn(self.attn_norm(u), positions, states, topk_relay)
            x = hc_post_first(y, x, post, comb)
        else:
            u, post, comb = self.hc_attn(x)
            y = self.attn(self.attn_norm(u), positions, states, topk_relay)
            x = self.ops.hc_post(y, x, post, comb)
        u, post, comb = self.hc_ffn(x)
        y = self.ffn(self.ffn_norm(u), token_ids)
        return self.ops.hc_post(y, x, post, comb)

    # The mHC pre-mixes, as functions of the block's own parameters. `pre` is the block's
    # `ops.hc_pre` (None) or a kernel of its signature (the paged forward passes its resolved op; for the first block
    # `kernels.mhc`'s `hc_pre_first_layer`, which takes the embedding [..., D] instead).
    def hc_attn(self, x: torch.Tensor, pre: HcPre | None = None) -> HcMix:
        """Streams x [..., M, D] -> (u [..., D], post [..., M], comb [..., M, M]) around
        attention."""
        pre = pre or self.ops.hc_pre
        return pre(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, *self._hc_args)

    def hc_ffn(self, x: torch.Tensor, pre: HcPre | None = None) -> HcMix:
        """Streams x [..., M, D] -> (u [..., D], post [..., M], comb [..., M, M]) around the
        MoE."""
        pre = pre or self.ops.hc_pre
        return pre(x, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, *self._hc_args)

    @property
    def _hc_args(self) -> tuple[int, float, float]:
        cfg = self.cfg
        return cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
