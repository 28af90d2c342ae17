"""The DeepSeek-V4 reference model (docs/model.md#forward): embed -> M streams -> blocks -> hc_head
-> norm -> head, plus the MTP layer (docs/model.md#mtp).

`state_dict()` keys are exactly the official checkpoint names (docs/model.md#checkpoint-names)
(`embed.weight`, `layers.{i}.attn.wq_a.weight`, `layers.{i}.ffn.experts.{e}.w1.weight`,
`mtp.0.e_proj.weight`, ...), with quantised weights held dequantised. Run it without states for a
full forward from position 0, or with one `SequenceState` per row to prefill in chunks and decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsv4.config.index_pattern import IndexPattern
from dsv4.config.model import ModelConfig
from dsv4.model.block import Block
from dsv4.model.hot_ops import REFERENCE_OPS, HotOps
from dsv4.model.index_cache import TopkRelay
from dsv4.model.layers import RMSNorm, linear
from dsv4.model.mtp import MTPLayer
from dsv4.model.state import SequenceState
from dsv4.ops.hyper import hc_head

# Parameters kept in fp32 whatever the model dtype (they are fp32 in the checkpoint,
# docs/model.md#forward).
FP32_PARAM_SUFFIXES = ("_fn", "_base", "_scale", ".ape", ".attn_sink", ".gate.bias")
_STORED_DTYPES = (torch.float8_e4m3fn, torch.float8_e8m0fnu)


@dataclass(frozen=True)
class ModelOutput:
    logits: torch.Tensor  # [B, S, V] fp32 ([B, 1, V] with last_only)
    streams: torch.Tensor  # [B, S, M, D]: final stream state before hc_head (MTP input)


class DeepseekV4(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, m = cfg.hidden_size, cfg.hc_mult
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(m, m * d))
        self.hc_head_base = nn.Parameter(torch.zeros(m))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        self.head = linear(d, cfg.vocab_size)
        self.mtp = nn.ModuleList(MTPLayer(cfg) for _ in range(min(cfg.num_nextn_predict_layers, 1)))
        # IndexCache roles of the ratio-4 layers (all Full = off); see set_index_pattern.
        self.index_pattern = IndexPattern.all_full(cfg)
        # First block: hc_pre/hc_post straight from the embedding (#48137); False materialises
        # the M identical streams first (the baseline). Same outputs either way.
        self.fuse_first_hc = True
        self.ops: HotOps = REFERENCE_OPS  # see use_hot_ops

    def cast_(self, dtype: torch.dtype) -> DeepseekV4:
        """Cast floating parameters to `dtype`, keeping the fp32 ones (`FP32_PARAM_SUFFIXES`) in
        fp32 (and FP8 linears held as stored, `dsv4.model.fp8`, as they are)."""
        for name, param in self.named_parameters():
            if param.dtype in _STORED_DTYPES or name.endswith(".scale"):  # an FP8Linear's
                continue
            target = torch.float32 if name.endswith(FP32_PARAM_SUFFIXES) else dtype
            param.data = param.data.to(target)
        return self

    def set_index_pattern(self, pattern: IndexPattern) -> DeepseekV4:
        """Serve with IndexCache: Shared ratio-4 layers reuse the preceding Full layer's top-k.
        The paged cache must be laid out with the same pattern (`CacheOptions.index_pattern`)."""
        if pattern.layer_ids != self.index_pattern.layer_ids:
            raise ValueError(f"pattern for layers {pattern.layer_ids}, model has a different set")
        self.index_pattern = pattern
        return self

    def use_hot_ops(self, ops: HotOps) -> DeepseekV4:
        """Serve with these hot-op implementations (`dsv4.model.hot_ops`; whoever builds the
        model resolves them once from the kernel config, `dsv4.runner.kernel_bridge`): every
        module that calls a hot op holds them as `.ops`. Default: the torch references."""
        self.ops = ops
        for module in self.modules():
            if isinstance(getattr(module, "ops", None), HotOps):
                module.ops = ops
        return self

    def new_state(self) -> SequenceState:
        return SequenceState.new(self.cfg)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        states: list[SequenceState] | None = None,
        last_only: bool = False,
        topk_relay: TopkRelay | None = None,
    ) -> ModelOutput:
        """input_ids [B, S] (or [S]); row b sits at positions states[b].num_tokens + 0..S-1
        (0.. without states). `positions`, if given, must say the same. States advance.
        `topk_relay` overrides the model's IndexCache pattern for this call (a fresh relay per
        call; indexcache-search passes one to try patterns and record every layer's top-k)."""
        squeeze = input_ids.dim() == 1
        ids = input_ids.unsqueeze(0) if squeeze else input_ids
        starts = [0] * ids.shape[0] if states is None else [st.num_tokens for st in states]
        positions = _check_positions(ids, starts, positions)
        x = self.embed(ids)  # [B, S, D]
        fused_first = self.fuse_first_hc
        if not fused_first:
            x = x.unsqueeze(-2).repeat_interleave(self.cfg.hc_mult, dim=-2)  # [B, S, M, D]
        relay = topk_relay
        if relay is None and not self.index_pattern.is_all_full:
            relay = TopkRelay(self.index_pattern)
        for i, layer in enumerate(self.layers):
            layer_states = None if states is None else [st.layers[i] for st in states]
            x = layer(
                x,
                ids,
                positions,
                layer_states,
                is_embedding=fused_first and i == 0,
                topk_relay=relay,
            )
        if states is not None:
            for st in states:
                st.num_tokens += ids.shape[1]
        cfg = self.cfg
        h = hc_head(
            x, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, cfg.hc_eps, cfg.rms_norm_eps
        )
        h = self.norm(h[:, -1:] if last_only else h)
        out = ModelOutput(self.head(h).float(), x)
        return _squeeze(out) if squeeze else out

    def mtp_forward(
        self,
        streams: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        states: list[SequenceState] | None = None,
        last_only: bool = False,
    ) -> ModelOutput:
        """Draft logits for token i+2 from the target streams at i [B, S, M, D] (or [S, M, D])
        and token i+1 `next_ids` [B, S]; positions are the target positions i (default
        states[b].mtp_num_tokens + 0..S-1). Returns the MTP's own post-block streams too."""
        if not len(self.mtp):
            raise ValueError("this model has no MTP layer (num_nextn_predict_layers = 0)")
        squeeze = next_ids.dim() == 1
        ids = next_ids.unsqueeze(0) if squeeze else next_ids
        streams = streams.unsqueeze(0) if squeeze else streams
        starts = [0] * ids.shape[0] if states is None else [st.mtp_num_tokens for st in states]
        positions = _check_positions(ids, starts, positions)
        mtp_states = None if states is None else [st.mtp for st in states]
        x1, h = self.mtp[0].draft(streams, self.embed(ids), ids, positions, mtp_states)
        if states is not None:
            for st in states:
                st.mtp_num_tokens += ids.shape[1]
        h = h[:, -1:] if last_only else h
        out = ModelOutput(self.head(h).float(), x1)
        return _squeeze(out) if squeeze else out


def _check_positions(
    ids: torch.Tensor, starts: list[int], positions: torch.Tensor | None
) -> torch.Tensor:
    steps = torch.arange(ids.shape[1], device=ids.device)
    expected = torch.tensor(starts, device=ids.device).unsqueeze(-1) + steps  # [B, S]
    if positions is not None:
        positions = positions.view_as(expected) if positions.dim() == 1 else positions
        if not torch.equal(positions.to(expected.device), expected):
            raise ValueError("positions must continue each row's state contiguously")
    return expected


def _squeeze(out: ModelOutput) -> ModelOutput:
    return ModelOutput(out.logits[0], out.streams[0])
