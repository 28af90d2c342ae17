"""Kernel-ready weights of the paged forward, derived once from the reference model.

- Routed experts: `dsv4.model.moe.ExpertWeights` (w13 [E, 2I, D], w2 [E, D, I]), the grouped-GEMM
  layout of `kernels.moe`; the per-expert parameters are views of it, so the weights exist
  once (the reference path still works). Experts served in the checkpoint's MXFP4 / FP8
  (`features.expert_weights=checkpoint`) are loaded straight into that layout, with scales.
- Compressors: wkv and wgate stacked once ([2 c d', D], one GEMM), in the model's dtype: the
  module's two weights become views of it, so the bytes exist once. The math is fp32
  (docs/model.md#compressor): `linear_fp32` multiplies bf16 by bf16 into fp32 on the tensor cores,
  whose products are exact, so no fp32 copy is made. The ape table is upcast once.
- Attention output: wo_a viewed [G, o_lora, (H/G) d] for the grouped projection.
- Router weight: the model's own (fp32 math through `linear_fp32`, as the compressor's). Router
  bias and attention sinks: fp32 once (converting per step was a copy kernel per layer).
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
    proj: torch.Tensor  # [2 c d', D] the model's dtype: wkv over wgate (one GEMM)
    ape: torch.Tensor  # [r, c d'] fp32: the gate's position bias, row p mod r


@dataclass(frozen=True)
class LayerWeights:
    experts: ExpertWeights  # a pool's: its [R + S] device rows
    compressor: CompressorWeights | None
    indexer_compressor: CompressorWeights | None
    gate_weight: torch.Tensor  # [E, D] the router's weight (the model's tensor)
    gate_bias: torch.Tensor | None  # [E] fp32 (None: a hash-routed layer)
    attn_sink: torch.Tensor  # [H] fp32 (a rank's H / W heads)
    pool: LayerPool | None = None  # offloaded experts (expert_pool.py): routed through it


def _stacked(comp) -> CompressorWeights:
    """wkv over wgate as one [2 c d', D] matrix; the module's weights become views of it (a
    second paged forward over the same model finds them stacked and shares the matrix)."""
    wkv, wgate = comp.wkv.weight, comp.wgate.weight
    n = wkv.shape[0]
    proj = getattr(comp, "stacked_proj", None)
    if (
        proj is None
        or proj[:n].data_ptr() != wkv.data_ptr()
        or proj[n:].data_ptr() != wgate.data_ptr()
    ):
        proj = torch.cat((wkv.data, wgate.data)).contiguous()
        wkv.data, wgate.data = proj[:n], proj[n:]
        comp.stacked_proj = proj
    return CompressorWeights(proj, comp.ape.float().contiguous())


def prepare_weights(model: DeepseekV4, mxfp4_layout: str = "stored") -> tuple[LayerWeights, ...]:
    """Per layer id: the main layers, then the MTP layer when the model has one (`mxfp4_layout`:
    `stack_experts`')."""
    out = []
    for block in (*model.layers, *model.mtp):
        attn = block.attn
        comp = _stacked(attn.compressor) if attn.compressor is not None else None
        idx = _stacked(attn.indexer.compressor) if attn.indexer is not None else None
        gate = block.ffn.gate
        bias = None if gate.is_hash else gate.bias.float().contiguous()
        pool = block.ffn.expert_pool
        experts = pool.weights if pool is not None else stack_experts(block.ffn, mxfp4_layout)
        out.append(LayerWeights(experts, comp, idx, gate.weight, bias,
                                attn.attn_sink.float().contiguous(), pool))  # fmt: skip
    return tuple(out)
