"""Kernel-ready weights of the paged forward, derived once from the reference model.

- Routed experts: w13 [E, 2I, D] (rows [0, I) = w1 gate, [I, 2I) = w3 up) and w2 [E, D, I], the
  grouped-GEMM layout of `kernels.moe`. The model's per-expert parameters are re-pointed at
  slices of the stacked tensors, so the weights exist once (the reference path still works).
- Compressors: wkv and wgate stacked and upcast to fp32 once ([2 c d', D]): the compressor's
  math is fp32 (DSV4_ARCH.md §6.4) and upcasting per step would re-read the bf16 weights.
- Attention output: wo_a viewed [G, o_lora, (H/G) d] for the grouped projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.errors import ConfigError
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.model.moe import MoE


@dataclass(frozen=True)
class ExpertWeights:
    w13: torch.Tensor  # [E, 2I, D]
    w2: torch.Tensor  # [E, D, I]


def stack_experts(moe: MoE) -> ExpertWeights:
    """Stack once and alias the expert modules' parameters to the stacked storage (a second
    paged forward over the same model, e.g. a benchmark's A/B variant, reuses the stack)."""
    if moe.expert_store is not None:
        raise ConfigError("forward", "paged", "offloaded experts need the reference forward")
    cached = getattr(moe, "stacked_experts", None)
    if cached is not None and cached.w13.data_ptr() == moe.experts[0].w1.weight.data_ptr():
        return cached
    experts = moe.experts
    w1 = experts[0].w1.weight
    inter, dim = w1.shape
    w13 = torch.empty(len(experts), 2 * inter, dim, dtype=w1.dtype, device=w1.device)
    w2 = torch.empty(len(experts), dim, inter, dtype=w1.dtype, device=w1.device)
    with torch.no_grad():
        for e, expert in enumerate(experts):
            w13[e, :inter].copy_(expert.w1.weight)
            w13[e, inter:].copy_(expert.w3.weight)
            w2[e].copy_(expert.w2.weight)
            expert.w1.weight.data = w13[e, :inter]
            expert.w3.weight.data = w13[e, inter:]
            expert.w2.weight.data = w2[e]
    moe.stacked_experts = ExpertWeights(w13, w2)
    return moe.stacked_experts


@dataclass(frozen=True)
class LayerWeights:
    experts: ExpertWeights
    compressor: torch.Tensor | None  # [2 c d, D] fp32
    indexer_compressor: torch.Tensor | None  # [2 c d_I, D] fp32


def _stacked_fp32(comp) -> torch.Tensor:
    return torch.cat((comp.wkv.weight, comp.wgate.weight)).float().contiguous()


def prepare_weights(model: DeepseekV4) -> tuple[LayerWeights, ...]:
    """Per layer id: the main layers, then the MTP layer when the model has one."""
    out = []
    for block in (*model.layers, *model.mtp):
        attn = block.attn
        comp = _stacked_fp32(attn.compressor) if attn.compressor is not None else None
        idx = _stacked_fp32(attn.indexer.compressor) if attn.indexer is not None else None
        out.append(LayerWeights(stack_experts(block.ffn), comp, idx))
    return tuple(out)
