"""Weight bytes by kind and storage format, exact from the checkpoint inventory, and per GPU.

Every logical tensor of `dsv4.model.inventory.model_tensors` is counted in the format it is
held in on the device: the checkpoint's own (FP8 linears + one UE8M0 byte per 128x128 block,
MXFP4 experts = half a byte per value + one UE8M0 byte per 32 values, bf16 embed/head/norms/
compressors, fp32 hc/ape/sink/bias, int64 tid2eid), or bf16 for quantised tensors when the
serving path dequantises them at load (the reference torch model does).

Sharding (per GPU of one replica; stated rules, vLLM-like):
- TP (`tp`): embed and head are vocab-parallel; the head-parallel attention projections
  (wq_b, wo_a, wo_b, attn_sink) and the shared expert (its intermediate dim) are split by tp;
  everything else (wq_a, wkv, compressors, the indexer, router, norms, hc) is replicated.
- EP (`ep`): each GPU holds ceil(E / ep) routed experts per layer. Without EP (ep = 1) the
  routed experts are TP-split along their intermediate dim instead.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass

from dsv4.config.model import ModelConfig
from dsv4.model.inventory import TensorSpec, model_tensors, quantized_kind

BYTES_PER_ELEMENT = {"bf16": 2, "fp32": 4, "int64": 8, "fp8": 1, "e8m0": 1}
MXFP4_BLOCK = 32
_TP_SPLIT_SUFFIXES = ("attn.wq_b.weight", "attn.wo_a.weight", "attn.wo_b.weight", "attn_sink")


@dataclass(frozen=True)
class WeightFormats:
    """How quantised tensors are held on the device: "checkpoint" or "bf16" (dequantised)."""

    linears: str = "checkpoint"
    experts: str = "checkpoint"


@dataclass(frozen=True)
class WeightItem:
    """All tensors of one kind and one format: whole model and on one GPU."""

    kind: str  # embed | head | attention | indexer | compressor | router | shared_experts |
    #            routed_experts | hc | norms | mtp_proj
    dtype: str  # bf16 | fp32 | int64 | fp8 | fp4 | e8m0
    is_mtp: bool
    total_bytes: int
    per_gpu_bytes: int


def tensor_kind(name: str, role: str) -> str:
    if name == "embed.weight":
        return "embed"
    if name == "head.weight":
        return "head"
    if ".ffn.experts." in name:
        return "routed_experts"
    if ".ffn.shared_experts." in name:
        return "shared_experts"
    if ".ffn.gate." in name:
        return "router"
    if role == "norm":
        return "norms"
    if role.startswith("hc_"):
        return "hc"
    if ".compressor." in name:
        return "compressor"
    if ".indexer." in name:
        return "indexer"
    if name.endswith(("e_proj.weight", "h_proj.weight")):
        return "mtp_proj"
    return "attention"


def stored_parts(
    spec: TensorSpec, cfg: ModelConfig, formats: WeightFormats
) -> list[tuple[str, int]]:
    """(dtype, bytes) of what one logical tensor occupies on the device."""
    kind = quantized_kind(spec.name, cfg)
    choice = formats.experts if ".ffn.experts." in spec.name else formats.linears
    numel = math.prod(spec.shape)
    if kind is None or choice == "bf16":
        fmt = "bf16" if kind is not None else spec.fmt
        return [(fmt, numel * BYTES_PER_ELEMENT[fmt])]
    rows, cols = spec.shape
    if kind == "fp4":  # two e2m1 values per byte, one UE8M0 scale per 32 values of a row
        return [("fp4", numel // 2), ("e8m0", rows * (cols // MXFP4_BLOCK))]
    b = cfg.fp8_block_size
    return [("fp8", numel), ("e8m0", -(-rows // b) * -(-cols // b))]


def shard_divisor(name: str, kind: str, tp: int, ep: int) -> int:
    """How many GPUs split this tensor (experts: the TP split; EP is counted per expert)."""
    if kind in ("embed", "head", "shared_experts") or name.endswith(_TP_SPLIT_SUFFIXES):
        return tp
    if kind == "routed_experts":
        return tp if ep == 1 else 1
    return 1


def expert_bytes(cfg: ModelConfig, formats: WeightFormats = WeightFormats()) -> int:
    """Bytes of ONE routed expert (w1, w2, w3 with their scales), unsharded."""
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size
    specs = [
        TensorSpec("layers.0.ffn.experts.0.w1.weight", (inter, d), "bf16", "linear"),
        TensorSpec("layers.0.ffn.experts.0.w2.weight", (d, inter), "bf16", "linear"),
        TensorSpec("layers.0.ffn.experts.0.w3.weight", (inter, d), "bf16", "linear"),
    ]
    return sum(b for spec in specs for _, b in stored_parts(spec, cfg, formats))


def experts_per_gpu(cfg: ModelConfig, ep: int) -> int:
    return -(-cfg.n_routed_experts // ep)


@functools.lru_cache(maxsize=16)  # a Pro inventory is ~140k tensors: plan sweeps reuse it
def weight_items(
    cfg: ModelConfig, tp: int, ep: int, include_mtp: bool, formats: WeightFormats
) -> tuple[WeightItem, ...]:
    """Every weight grouped by (kind, dtype, is_mtp), with its bytes on one GPU."""
    total: dict[tuple[str, str, bool], int] = defaultdict(int)
    per_gpu: dict[tuple[str, str, bool], float] = defaultdict(float)
    local_share = experts_per_gpu(cfg, ep) / cfg.n_routed_experts
    for spec in model_tensors(cfg, include_mtp=include_mtp):
        kind = tensor_kind(spec.name, spec.role)
        divisor = shard_divisor(spec.name, kind, tp, ep)
        share = local_share if kind == "routed_experts" else 1.0
        for dtype, nbytes in stored_parts(spec, cfg, formats):
            key = (kind, dtype, spec.name.startswith("mtp."))
            total[key] += nbytes
            per_gpu[key] += nbytes * share / divisor
    return tuple(
        WeightItem(kind, dtype, is_mtp, total[(kind, dtype, is_mtp)], math.ceil(per_gpu[key]))
        for key in sorted(total)
        for kind, dtype, is_mtp in [key]
    )
