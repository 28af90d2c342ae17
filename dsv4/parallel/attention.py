"""Tensor-parallel attention: each rank computes the query heads of o_groups / world output
groups (docs/model.md#grouped-output-projection) and the partial output projections are summed.

Rank r of W keeps, with H heads, G groups, hd = head_dim, o = o_lora_rank, h = H / W, g = G / W:
- `wq_b` rows [r*h*hd, (r+1)*h*hd)       (head-major: head i is rows i*hd .. (i+1)*hd)
- `attn_sink` [r*h, (r+1)*h)
- `wo_a` rows [r*g*o, (r+1)*g*o)         (group-major: group j is rows j*o .. (j+1)*o)
- `wo_b` columns [r*g*o, (r+1)*g*o)      (its output [B, S, D] is a partial sum: all-reduced)
Heads of a group are consecutive, so the rank's heads are exactly its groups' heads.
Replicated (the original modules, shared): `wq_a`, `q_norm`, `wkv`, `kv_norm`, the compressor
and the indexer. The KV has a single head, so every rank computes and caches all of it (as
vLLM does for MQA) and the per-row attention runs unchanged over the rank's h heads.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.model.attention import Attention
from dsv4.model.index_cache import TopkRelay
from dsv4.model.state import LayerState
from dsv4.parallel.group import ParallelGroup


def rank_slice(size: int, group: ParallelGroup) -> slice:
    """This rank's contiguous 1/world share of `size` (divisibility checked by the caller)."""
    share = size // group.world_size
    return slice(group.rank * share, (group.rank + 1) * share)


def sliced_param(param: nn.Parameter, rows: slice, cols: slice = slice(None)) -> nn.Parameter:
    """A copy of param[rows, cols] (a copy, so the full tensor is freed with its module)."""
    part = param.detach()[rows, cols] if param.dim() == 2 else param.detach()[rows]
    return nn.Parameter(part.clone(), requires_grad=param.requires_grad)


class TensorParallelAttention(Attention):
    """`Attention` over this rank's heads, its output all-reduced (fp32) across the group.

    NOTE: `self.cfg` is the rank's view of the model config: num_attention_heads and o_groups
    divided by the world size. Those two fields are all Attention's forward reads to size the
    heads and groups; the model's and the block's cfg keep the full counts. At world size 1 the
    view equals the model config and the forward is the unsharded one, bit for bit.
    """

    def __init__(self, attn: Attention, group: ParallelGroup) -> None:
        full = attn.cfg
        local = full.with_overrides(
            num_attention_heads=full.num_attention_heads // group.world_size,
            o_groups=full.o_groups // group.world_size,
        )
        # Build the module skeleton at the local shapes without allocating: every parameter
        # is replaced below, either by the original replicated module or by the rank's slice.
        with torch.device("meta"):
            super().__init__(local, attn.layer_id)
        self.group = group
        self.wq_a, self.q_norm = attn.wq_a, attn.q_norm
        self.wkv, self.kv_norm = attn.wkv, attn.kv_norm
        self.compressor, self.indexer = attn.compressor, attn.indexer
        hd, o = full.head_dim, full.o_lora_rank
        heads = rank_slice(full.num_attention_heads, group)
        groups = rank_slice(full.o_groups, group)
        head_rows = slice(heads.start * hd, heads.stop * hd)
        group_rows = slice(groups.start * o, groups.stop * o)
        self.wq_b.weight = sliced_param(attn.wq_b.weight, head_rows)  # [h*hd, q_lora]
        self.attn_sink = sliced_param(attn.attn_sink, heads)  # [h]
        self.wo_a.weight = sliced_param(attn.wo_a.weight, group_rows)  # [g*o, (H/G)*hd]
        self.wo_b.weight = sliced_param(attn.wo_b.weight, slice(None), group_rows)  # [D, g*o]

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        states: list[LayerState] | None,
        topk_relay: TopkRelay | None = None,
    ) -> torch.Tensor:
        """x [B, S, D] -> [B, S, D], the same on every rank (collective: all ranks must call)."""
        partial = super().forward(x, positions, states, topk_relay)  # [B, S, D], rank's heads
        return self.group.all_reduce_fp32(partial)
