"""Kernel-ready weights of the paged forward, derived once from the reference model.

- Routed experts: `dsv4.model.moe.ExpertWeights` (w13 [E, 2I, D], w2 [E, D, I]), the grouped-GEMM
  layout of `kernels.moe`; the per-expert parameters are views of it, so the weights exist
  once (the reference path still works). Experts served in the checkpoint's MXFP4 / FP8
  (`features.expert_weights=checkpoint`) are loaded straight into that layout, with scales.
- Compressors: wkv and wgate stacked and upcast to fp32 once ([2 c d', D]), and the ape table
  upcast once: the compressor's math is fp32 (docs/model.md#compressor) and upcasting per step would
  re-read the bf16 weights (and launch a cast per compressor).
- Attention output: wo_a viewed [G, o_lora, (H/G) d] for the grouped projection.
- Router weight and bias, attention sinks: fp32 copies made once (the router's and the sink's
  math is fp32; converting per step was a copy kernel per layer in every decode step).
On a rank of a sharded replica (`dsv4.parallel.shard_model`) they come from its shard: the
rank's experts (or every expert's intermediate slice), its heads' sinks and output groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.errors import ConfigError
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.model.moe import ExpertWeights, MoE, mxfp4_layout_, routed_modules, stack_experts_
from dsv4.runner.paged.expert_pool import LayerPool


def stack_experts(moe: MoE, mxfp4_layout: str = "stored") -> ExpertWeights:
    """The layer's stacked experts: built with the model (`random_model`), by an earlier paged
    forward over the same model (a benchmark's A/B variant), or stacked here once. MXFP4 ones
    in `mxfp4_layout` (`features.mxfp4_layout`: re-packed in place once, `mxfp4_layout_`)."""
    if moe.expert_store is not None:
        raise ConfigError("forward", "paged", "offloaded experts reach the paged forward "
                          "through an expert pool: dsv4.runner.paged.pool_experts")  # fmt: skip
    cached = moe.stacked_experts
    if cached is not None and cached.is_quantized:  # loaded stacked: the only copy
        return mxfp4_layout_(moe, mxfp4_layout)
    if cached is not None and cached.w13.data_ptr() == routed_modules(moe)[0].w1.weight.data_ptr():
        return cached
    stacked = stack_experts_(moe)
    if stacked.w13.is_cuda:  # hand the per-expert blocks back before the next layer stacks
        torch.cuda.empty_cache()
    return stacked


@dataclass(frozen=True)
class CompressorWeights:
    proj: torch.Tensor  # [2 c d', D] fp32: wkv over wgate (one GEMM)
    ape: torch.Tensor  # [r, c d'] fp32: the gate's position bias, row p mod r


@dataclass(frozen=True)
class LayerWeights:
    experts: ExpertWeights  # a pool's: its [R + S] device rows
    compressor: CompressorWeights | None
    indexer_compressor: CompressorWeights | None
    gate_weight: torch.Tensor  # [E, D] fp32
    gate_bias: torch.Tensor | None  # [E] fp32 (None: a hash-routed layer)
    attn_sink: torch.Tensor  # [H] fp32 (a rank's H / W heads)
    pool: LayerPool | None = None  # offloaded experts (expert_pool.py): routed through it


def _stacked_fp32(comp) -> CompressorWeights:
    proj = torch.cat((comp.wkv.weight, comp.wgate.weight)).float().contiguous()
    return CompressorWeights(proj, comp.ape.float().contiguous())


def prepare_weights(model: DeepseekV4, mxfp4_layout: str = "stored") -> tuple[LayerWeights, ...]:
    """Per layer id: the main layers, then the MTP layer when the model has one (`mxfp4_layout`:
    `stack_experts`')."""
    out = []
    for block in (*model.layers, *model.mtp):
        attn = block.attn
        comp = _stacked_fp32(attn.compressor) if attn.compressor is not None else None
        idx = _stacked_fp32(attn.indexer.compressor) if attn.indexer is not None else None
        gate = block.ffn.gate
        bias = None if gate.is_hash else gate.bias.float().contiguous()
        pool = block.ffn.expert_pool
        experts = pool.weights if pool is not None else stack_experts(block.ffn, mxfp4_layout)
        out.append(LayerWeights(experts, comp, idx, gate.weight.float().contiguous(), bias,
                                attn.attn_sink.float().contiguous(), pool))  # fmt: skip
    return tuple(out)
