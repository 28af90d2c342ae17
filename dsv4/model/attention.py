"""DeepSeek-V4 attention: shared K=V MQA over a sliding window plus compressed entries, with
a per-head sink and a grouped low-rank output projection (docs/model.md#attention).

The three kinds, by compress ratio r (docs/model.md#attention):
- r = 0: window only, plain rope (rope_theta);
- r = 4: window + the indexer's top-k of the overlapping ratio-4 compressed entries;
- r = 128: window + every available ratio-128 entry (i < floor((p + 1) / 128)).
Compressed layers use the YaRN rope of compress_rope_theta for q, kv, entries and indexer.
All candidates share one softmax with the sink; values are the keys (incl. roped dims), and the
output's rope dims are rotated back by the query position before the output projection.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.config.model import ModelConfig
from dsv4.model.compressor import Compressor
from dsv4.model.fp8 import grouped_linear
from dsv4.model.hot_ops import REFERENCE_OPS, HotOps
from dsv4.model.index_cache import TopkRelay
from dsv4.model.indexer import Indexer
from dsv4.model.layers import RMSNorm, linear
from dsv4.model.rope import inv_freq
from dsv4.model.state import LayerState
from dsv4.ops.norm import rms_norm
from dsv4.ops.rope import apply_rope, rope_cos_sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        self.ratio = cfg.layer_ratio(layer_id)
        h, hd, d = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
        self.wq_a = linear(d, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = linear(cfg.q_lora_rank, h * hd)
        self.wkv = linear(d, hd)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.wo_a = linear(h * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = linear(cfg.o_groups * cfg.o_lora_rank, d)
        self.attn_sink = nn.Parameter(torch.zeros(h))
        self.compressor = Compressor(cfg, self.ratio, hd) if self.ratio else None
        self.indexer = Indexer(cfg) if self.ratio == 4 else None
        self.ops: HotOps = REFERENCE_OPS  # sparse_attention (DeepseekV4.use_hot_ops)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        states: list[LayerState] | None,
        topk_relay: TopkRelay | None = None,
    ) -> torch.Tensor:
        """x [B, S, D] (attn_norm applied), positions [B, S] contiguous per row -> [B, S, D].

        With `states` (one per row) the rows continue their cached prefix and the states are
        advanced; without, every row starts at position 0. `topk_relay` (IndexCache) hands
        top-k from Full to Shared ratio-4 layers of this forward; None: every layer is Full.
        """
        cfg = self.cfg
        b, s, _ = x.shape
        h, hd = cfg.num_attention_heads, cfg.head_dim
        cos, sin = rope_cos_sin(positions, inv_freq(cfg, self.ratio, x.device))  # [B, S, r/2]
        qr = self.q_norm(self.wq_a(x))  # [B, S, q_lora]
        q = rms_norm(self.wq_b(qr).view(b, s, h, hd), None, cfg.rms_norm_eps)
        kv = self.kv_norm(self.wkv(x))  # [B, S, hd]
        out = x.new_empty(b, s, h, hd)
        for row in range(b):
            q_row = apply_rope(q[row], cos[row], sin[row])  # [S, H, hd]
            kv_row = apply_rope(kv[row], cos[row], sin[row])  # [S, hd]
            state = None if states is None else states[row]
            o = self._attend_row(
                x[row], qr[row], q_row, kv_row, positions[row], state, cos[row], sin[row],
                (row, topk_relay),
            )  # fmt: skip
            out[row] = apply_rope(o, cos[row], sin[row], inverse=True).to(x.dtype)
        return self._project_out(out)

    def _attend_row(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        q: torch.Tensor,
        kv: torch.Tensor,
        positions: torch.Tensor,
        state: LayerState | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        relay: tuple[int, TopkRelay | None],
    ) -> torch.Tensor:
        """One sequence: q [S, H, hd], kv [S, hd] (roped) -> o [S, H, hd] fp32.
        `relay`: (batch row, the forward's TopkRelay or None)."""
        w = self.cfg.sliding_window
        start = int(positions[0])
        past = kv.new_zeros(0, kv.shape[-1])
        if state is not None and state.window is not None:
            past = state.window
        # The step's own rows as a later step reads them from the cache (chunk invariance);
        # the state keeps them raw, since the cache encodes what the state holds.
        keys = torch.cat((past, kv if state is None else state.as_stored(kv)))  # [Wp + S, hd]
        key_pos = torch.arange(start - past.shape[0], start + kv.shape[0], device=kv.device)
        diff = positions.unsqueeze(-1) - key_pos  # [S, Wp + S]
        visible = (diff >= 0) & (diff < w)
        if state is not None:
            raw = torch.cat((past, kv))
            state.window = raw[-(w - 1) :].clone() if w > 1 else raw[:0]
        if self.compressor is not None:
            entries, entry_visible = self._compressed(x, qr, positions, state, cos, sin, relay)
            keys = torch.cat((keys, entries))
            visible = torch.cat((visible, entry_visible), dim=-1)
        return self.ops.sparse_attention(q, keys, visible, self.attn_sink, self.cfg.head_dim**-0.5)

    def _compressed(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        positions: torch.Tensor,
        state: LayerState | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        relay: tuple[int, TopkRelay | None],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> entries [N, hd] and which of them each query attends to [S, N] bool."""
        start = int(positions[0])
        entries = self.compressor(x, start, None if state is None else state.compressor)
        n = entries.shape[0]
        if self.indexer is None:  # ratio 128: every available entry
            available = (positions + 1) // self.ratio
            return entries, torch.arange(n, device=x.device) < available.unsqueeze(-1)
        chosen = self._topk(x, qr, positions, state, cos, sin, relay)  # [S, k]
        visible = torch.zeros(positions.shape[0], n + 1, dtype=torch.bool, device=x.device)
        visible.scatter_(1, torch.where(chosen >= 0, chosen, n), True)  # -1 -> dummy column n
        return entries, visible[:, :n]

    def _topk(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        positions: torch.Tensor,
        state: LayerState | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        relay: tuple[int, TopkRelay | None],
    ) -> torch.Tensor:
        """Local entry indices [S, k] (-1 padded) from this layer's indexer, or, for an
        IndexCache Shared layer, those its Full source layer published in this forward (all C4
        layers compress the same tokens, so entry i means the same window in both)."""
        row, topk_relay = relay
        if topk_relay is not None and topk_relay.is_shared(self.layer_id):
            return topk_relay.take(self.layer_id, row)  # no keys, q-proj, logits or top-k
        if state is not None and state.indexer is None:
            raise RuntimeError(
                f"layer {self.layer_id} runs its indexer but its state has no indexer keys: "
                "build the cache layout with the model's index pattern"
            )
        chosen = self.indexer(x, qr, positions, cos, sin, None if state is None else state.indexer)
        if topk_relay is not None:
            topk_relay.publish(self.layer_id, row, chosen)
        return chosen

    def _project_out(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, S, H, hd] -> grouped low-rank projection -> [B, S, D]."""
        cfg = self.cfg
        b, s = o.shape[:2]
        grouped = o.reshape(b, s, cfg.o_groups, -1)  # [B, S, G, (H/G)*hd]
        z = grouped_linear(self.wo_a, grouped)  # [B, S, G, o_lora]: wo_a [G*o_lora, (H/G)*hd]
        return self.wo_b(z.flatten(2))
