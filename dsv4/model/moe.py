"""Mixture of experts (docs/model.md#moe): every layer (and the MTP layer) is MoE.

Router: g = W_g u (fp32), s = sqrt(softplus(g)).
- hash layers (layer_id < num_hash_layers): experts = tid2eid[token id] (no bias);
- scored layers: experts = top-k of s + bias (the bias only selects).
Weights: the unbiased s of the chosen experts, renormalised, times routed_scaling_factor.
Experts are SwiGLU with the gate clamped above and the up-projection clamped to +-limit;
the shared expert too unless `cfg.clamp_shared_expert` is False (docs/model.md#moe).

Routed experts are held either as modules in the model dtype (`experts`, stacked for the grouped
GEMM by `stack_experts_`) or, served in the checkpoint's own MXFP4 / FP8 format, only as one
quantised stacked storage (`quantized_experts_`): the paged forward hands it to the kernel as
is, and this module's reference forward dequantises each selected expert per call (exact: the
values a dequantising load would hold). The router and expert math are `dsv4.ops.moe`; the
router runs through the model's hot ops (`dsv4.model.hot_ops`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import nn

from dsv4.config.model import ModelConfig
from dsv4.errors import ConfigError
from dsv4.model.hot_ops import REFERENCE_OPS, HotOps
from dsv4.model.layers import linear, linear_fp32
from dsv4.ops.moe import gated_silu, swiglu
from dsv4.ops.quant import (
    HALVES_MAX_SCALE_BYTE,
    MXFP4_BLOCK,
    dequantize,
    halves_block,
    halves_scales_fit,
    repack_halves,
    unpack_halves,
)

logger = logging.getLogger(__name__)

# ModelConfig.expert_dtype of a checkpoint -> the `kernels.moe` format its experts are served in
SERVED_FORMATS = {"fp4": "mxfp4", "fp8": "fp8"}
FP8_BLOCK = 128  # the grouped GEMM's FP8 scale block
# `features.mxfp4_layout` -> the format MXFP4 experts are served in on the paged forward: the
# re-packed "halves" layout of K block 128 (kernels/moe_gemv.py to 128 tokens, the halves MMA
# kernel above) or the checkpoint's own (the A/B baseline)
MXFP4_LAYOUTS = {"halves128": "mxfp4_halves128", "stored": "mxfp4"}


class Gate(nn.Module):
    """`ffn.gate.weight` [E, D]; `.bias` [E] fp32 (scored) or `.tid2eid` [V, K] int64 (hash)."""

    def __init__(self, cfg: ModelConfig, is_hash: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.is_hash = is_hash
        self.ops: HotOps = REFERENCE_OPS  # route (DeepseekV4.use_hot_ops)
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if is_hash:
            table = torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int64)
            self.register_buffer("tid2eid", table)
            self.bias = None
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))

    def forward(
        self, u: torch.Tensor, token_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """u [T, D], token_ids [T] -> (weights [T, K] fp32, ids [T, K])."""
        logits = linear_fp32(u, self.weight)
        table = self.tid2eid if self.is_hash else None
        cfg = self.cfg
        return self.ops.route(
            logits, self.bias, token_ids, table, cfg.num_experts_per_tok, cfg.routed_scaling_factor
        )


class ExpertStore(Protocol):
    """Where `MoE.forward` gets routed experts when they are not its resident `experts`
    modules (`dsv4.model.offload`). Called from the forward, on the model's thread."""

    def prepare(self, ids: torch.Tensor) -> None:
        """Once per forward with the routed ids [T, K], before any `expert` call: start
        fetching the selected experts that are not on the device."""

    def expert(self, e: int, num_tokens: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """Expert `e` as a function u [n, D] -> [n, D] with `swiglu`'s math; waits for its
        weights if they are still in flight."""


class Expert(nn.Module):
    """SwiGLU: w2(silu(min(w1 u, limit)) * clamp(w3 u, -limit, limit)); limit None = no clamp."""

    def __init__(self, dim: int, inter: int, limit: float | None) -> None:
        super().__init__()
        self.w1 = linear(dim, inter)
        self.w2 = linear(inter, dim)
        self.w3 = linear(dim, inter)
        self.limit = limit

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        # through the modules (`swiglu`'s math): dense, or `FP8Linear` for a shared expert
        # held as stored (features.linear_weights)
        return self.w2(gated_silu(self.w1(u), self.w3(u), self.limit).to(u.dtype))


# The routing kernels' signatures (`kernels.routing`): (logits [T, E], bias [E], top_k,
# scaling) and (logits [T, E], token_ids [T], tid2eid [V, K], scaling) -> (weights, ids).
ScoredRoute = Callable[[torch.Tensor, torch.Tensor, int, float], tuple[torch.Tensor, torch.Tensor]]
HashRoute = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
]


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.cfg = cfg
        d, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Gate(cfg, cfg.is_hash_layer(layer_id))
        self.experts = nn.ModuleList(
            Expert(d, inter, cfg.swiglu_limit) for _ in range(cfg.n_routed_experts)
        )
        self.shared_experts = None
        if cfg.n_shared_experts:
            limit = cfg.swiglu_limit if cfg.clamp_shared_expert else None
            self.shared_experts = Expert(d, inter * cfg.n_shared_experts, limit)
        # None: the `experts` modules above; else an offloaded store (dsv4.model.offload).
        self.expert_store: ExpertStore | None = None
        # the paged forward's expert pool (dsv4.runner.paged.expert_pool) once the experts
        # moved there: this module's own forward then refuses to run
        self.expert_pool: object | None = None
        # set by `stack_experts_` (views of `experts`) or `quantized_experts_` (the only copy)
        self.stacked_experts: ExpertWeights | None = None
        # None, or told the routed ids [T, K] of every forward (expert popularity statistics,
        # installed by the runner: dsv4.runner.routing_stats)
        self.route_observer: Callable[[torch.Tensor], None] | None = None

    def forward(self, u: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """u [..., D] (ffn_norm applied), token_ids [...] -> [..., D]."""
        if self.expert_pool is not None:
            raise ConfigError("features.forward", "reference", "the routed experts live in "
                              "the paged forward's expert pool: serve with --forward paged")  # fmt: skip
        shape = u.shape
        flat = u.reshape(-1, shape[-1])  # [T, D]
        weights, ids = self.gate(flat, token_ids.reshape(-1))  # [T, K]
        if self.route_observer is not None:
            self.route_observer(ids)
        out = torch.zeros(flat.shape, dtype=torch.float32, device=u.device)
        if self.expert_store is not None:
            self.expert_store.prepare(ids)
        # NOTE: dispatch by expert (token lists per expert), fp32 accumulation; the order is
        # the same with a store, so offloaded outputs equal resident ones bit for bit.
        for e in ids.unique().tolist():
            token_idx, slot = torch.where(ids == e)
            expert = self._expert(e, token_idx.numel())
            y = expert(flat[token_idx]).float() * weights[token_idx, slot].unsqueeze(-1)
            out.index_add_(0, token_idx, y)
        if self.shared_experts is not None:
            out += self.shared_experts(flat).float()
        return out.to(u.dtype).view(shape)

    def route(
        self,
        logits: torch.Tensor,
        token_ids: torch.Tensor,
        scored: ScoredRoute,
        hashed: HashRoute,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's choice on gate logits [T, E] fp32 (g = W_g u) -> (weights [T, K] fp32,
        expert ids [T, K]): by token id through `tid2eid` on a hash layer, else top-k of the
        scores + bias. `scored` / `hashed`: `kernels.routing`'s `route` / `hash_route` (or
        their references); `bias`: the gate bias as the caller holds it (an fp32 copy)."""
        cfg, gate = self.cfg, self.gate
        if gate.is_hash:
            return hashed(logits, token_ids, gate.tid2eid, cfg.routed_scaling_factor)
        bias = gate.bias if bias is None else bias
        return scored(logits, bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor)

    def _expert(self, e: int, num_tokens: int) -> Callable[[torch.Tensor], torch.Tensor]:
        if self.expert_store is not None:
            return self.expert_store.expert(e, num_tokens)
        stacked = self.stacked_experts
        if stacked is None or not stacked.is_quantized:
            return self.experts[e]
        limit = self.cfg.swiglu_limit
        return lambda u: swiglu(u, *stacked.dequantized(e, u.dtype), limit)


@dataclass(frozen=True)
class ExpertWeights:
    """One MoE layer's routed experts in the grouped-GEMM layout of `kernels.moe`, in its
    `format`:
    - "bf16" (the model dtype): w13 [E, 2I, D] (rows [0, I) = w1 gate, [I, 2I) = w3 up), w2
      [E, D, I]. When the shared expert has a routed expert's shape, dtype and clamp it lives
      in slot E of the same storage (`w13_all` [E + 1, 2I, D], `w2_all`), so the grouped GEMM
      can run it as one more expert (`w13`, `w2` are then views of the first E slots);
    - "mxfp4": int8 w13 [E, 2I, D/2], w2 [E, D, I/2] (packed e2m1 pairs, low nibble = even
      column), UE8M0 `w13_scale` [E, 2I, D/32], `w2_scale` [E, D, I/32]; "mxfp4_halves128":
      the same codes re-packed row by row (`dsv4.ops.quant.repack_halves`, `mxfp4_layout_`);
    - "fp8": e4m3 w13, w2 of the bf16 shapes, 128x128 block scales (UE8M0 or fp32)
      `w13_scale` [E, 2I/128, ceil(D/128)], `w2_scale` [E, ceil(D/128), ceil(I/128)].
    The quantised formats never hold the shared expert (it is dequantised: another format)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_all: torch.Tensor | None = None
    w2_all: torch.Tensor | None = None
    format: str = "bf16"
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None

    @property
    def is_quantized(self) -> bool:
        return self.format != "bf16"

    @property
    def nbytes(self) -> int:
        """Device bytes of the E routed experts, scales included (a shared slot E excluded)."""
        parts = (self.w13, self.w2, self.w13_scale, self.w2_scale)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def parts(self, e: int) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """Expert e's w1, w2, w3 as (weight, scale) views of the storage, in the checkpoint's
        per-expert shapes (docs/model.md#checkpoint-names): what a loader fills."""
        inter = self.w13.shape[1] // 2
        split = inter // FP8_BLOCK if self.format == "fp8" else inter  # w1's scale rows
        s13 = self.w13_scale[e] if self.w13_scale is not None else None
        s2 = self.w2_scale[e] if self.w2_scale is not None else None
        return {
            "w1": (self.w13[e, :inter], None if s13 is None else s13[:split]),
            "w2": (self.w2[e], s2),
            "w3": (self.w13[e, inter:], None if s13 is None else s13[split:]),
        }

    def dequantized(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Expert e's (w1, w2, w3) dense in `dtype` (`swiglu`'s argument order)."""
        views = self.parts(e)
        return tuple(dequantize(w, s, self.format, dtype) for w, s in
                     (views["w1"], views["w2"], views["w3"]))  # fmt: skip


def served_expert_format(cfg: ModelConfig, expert_weights: str) -> str:
    """The format routed experts are held in: "bf16" (the model dtype: `expert_weights` "bf16",
    or a checkpoint of bf16 experts) or the checkpoint's "mxfp4" / "fp8" (`expert_weights`
    "checkpoint", `features.expert_weights`)."""
    if expert_weights not in ("bf16", "checkpoint"):
        raise ConfigError("features.expert_weights", expert_weights, "use bf16 or checkpoint")
    if expert_weights == "bf16":
        return "bf16"
    return SERVED_FORMATS.get(cfg.expert_dtype, "bf16")


def routed_modules(moe: MoE) -> list[Expert]:
    """The routed expert modules in slot order (a rank's shard keys its experts by global id
    in an `nn.ModuleDict`: `dsv4.parallel.moe`)."""
    experts = moe.experts
    return list(experts.values() if isinstance(experts, nn.ModuleDict) else experts)


def _shares_layout(moe: MoE) -> bool:
    shared, first = moe.shared_experts, routed_modules(moe)[0]
    return (shared is not None and shared.w1.weight.shape == first.w1.weight.shape
            and shared.w1.weight.dtype == first.w1.weight.dtype
            and shared.limit == first.limit)  # fmt: skip


def stack_experts_(moe: MoE, device: torch.device | str | None = None) -> ExpertWeights:
    """Give the routed experts (and a same-shaped shared expert, in slot E) ONE stacked storage
    and re-point every expert's parameters at slices of it, so the weights exist once (the
    per-expert modules still work). Values are copied over, unless the experts are still on the
    meta device (a model being built: the storage is then allocated on `device` and filled by
    the caller). Kept on the module as `moe.stacked_experts`."""
    routed = routed_modules(moe)
    first = routed[0].w1.weight
    inter, dim = first.shape
    device = first.device if device is None else torch.device(device)
    e = len(routed)
    experts = [*routed, *([moe.shared_experts] if _shares_layout(moe) else [])]
    w13 = torch.empty(len(experts), 2 * inter, dim, dtype=first.dtype, device=device)
    w2 = torch.empty(len(experts), dim, inter, dtype=first.dtype, device=device)
    with torch.no_grad():
        for i, expert in enumerate(experts):
            views = (w13[i, :inter], w13[i, inter:], w2[i])
            for module, view in zip((expert.w1, expert.w3, expert.w2), views):
                if not module.weight.is_meta:
                    view.copy_(module.weight)
                module.weight = nn.Parameter(view, requires_grad=False)
    fused = len(experts) > e
    moe.stacked_experts = ExpertWeights(w13[:e], w2[:e], w13 if fused else None,
                                        w2 if fused else None)  # fmt: skip
    return moe.stacked_experts


def quantized_experts_(
    moe: MoE, fmt: str, device: torch.device | str, scale_dtype: torch.dtype | None = None
) -> ExpertWeights:
    """Replace the routed expert modules by ONE stacked storage in the checkpoint's format `fmt`
    ("mxfp4" | "fp8"), allocated empty on `device` for a loader to fill through `parts`, so no
    dense copy ever exists. `scale_dtype`: the FP8 scales' (UE8M0 default, or fp32); MXFP4
    scales are UE8M0. Kept on the module as `moe.stacked_experts`."""
    cfg = moe.cfg
    e, d, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    if fmt == "mxfp4":
        shapes = ((e, 2 * inter, d // 2), (e, d, inter // 2),
                  (e, 2 * inter, d // MXFP4_BLOCK), (e, d, inter // MXFP4_BLOCK))  # fmt: skip
        dtypes = (torch.int8, torch.int8, torch.float8_e8m0fnu, torch.float8_e8m0fnu)
    elif fmt == "fp8":
        if cfg.fp8_block_size != FP8_BLOCK or inter % FP8_BLOCK:
            raise ConfigError("features.expert_weights", "checkpoint",
                              f"FP8 experts are served with {FP8_BLOCK}x{FP8_BLOCK} scale blocks "
                              f"and moe_intermediate_size a multiple of {FP8_BLOCK} (this model: "
                              f"blocks {cfg.fp8_block_size}, I {inter}): serve them as bf16")  # fmt: skip
        blocks = lambda n: -(-n // FP8_BLOCK)  # noqa: E731
        shapes = ((e, 2 * inter, d), (e, d, inter),
                  (e, 2 * inter // FP8_BLOCK, blocks(d)), (e, blocks(d), blocks(inter)))  # fmt: skip
        scale = scale_dtype or torch.float8_e8m0fnu
        dtypes = (torch.float8_e4m3fn, torch.float8_e4m3fn, scale, scale)
    else:
        raise ValueError(f"not a quantised expert format: {fmt!r}")
    w13, w2, s13, s2 = (torch.empty(s, dtype=t, device=device) for s, t in zip(shapes, dtypes))
    moe.experts = nn.ModuleList()  # the stacked storage is the only copy
    moe.stacked_experts = ExpertWeights(w13, w2, format=fmt, w13_scale=s13, w2_scale=s2)
    return moe.stacked_experts


def halves_fit(dim: int, inter: int) -> bool:
    """Whether experts of hidden size `dim` and intermediate size `inter` re-pack into
    "mxfp4_halves128" (both the rows of w13 and of w2 in whole 128-column blocks)."""
    return dim % 128 == 0 and inter % 128 == 0


def mxfp4_format(cfg, layout: str) -> str:
    """The format MXFP4 experts of `cfg` are served in under `layout` (a key of MXFP4_LAYOUTS):
    experts whose dimensions are not multiples of 128 (`halves_fit`) stay "mxfp4"."""
    if layout not in MXFP4_LAYOUTS:
        raise ConfigError("features.mxfp4_layout", layout, f"use one of {sorted(MXFP4_LAYOUTS)}")
    if not halves_fit(cfg.hidden_size, cfg.moe_intermediate_size):
        return "mxfp4"
    return MXFP4_LAYOUTS[layout]


def mxfp4_layout_(moe: MoE, layout: str) -> ExpertWeights | None:
    """Hold the layer's stacked MXFP4 experts in `layout` (a key of MXFP4_LAYOUTS): re-packed
    in place, one expert at a time (no second copy), and `moe.stacked_experts` renamed to the
    format. The reference forward reads either (`ExpertWeights.dequantized` unpacks). Other
    formats, experts already in `layout`, and dimensions not multiples of 128 (`halves_fit`)
    are left as they are; experts with a scale byte above HALVES_MAX_SCALE_BYTE keep (or get)
    the stored layout. Returns the storage."""
    stacked, want = moe.stacked_experts, mxfp4_format(moe.cfg, layout)
    if stacked is None or stacked.format not in MXFP4_LAYOUTS.values() or stacked.format == want:
        return stacked
    if halves_block(want) and not halves_scales_fit(stacked.w13_scale, stacked.w2_scale):
        logger.warning("MXFP4 experts with scale bytes above %d (weights of 16 or more), which "
                       "the halves layouts do not hold: this layer keeps the stored layout",
                       HALVES_MAX_SCALE_BYTE)  # fmt: skip
        want = "mxfp4"
        if stacked.format == want:
            return stacked
    with torch.no_grad():
        for w in (stacked.w13, stacked.w2):
            for e in range(w.shape[0]):
                unpacked = w[e] if stacked.format == "mxfp4" else unpack_halves(
                    w[e], halves_block(stacked.format))  # fmt: skip
                w[e].copy_(unpacked if want == "mxfp4" else repack_halves(unpacked, 128))
    moe.stacked_experts = replace(stacked, format=want)
    return moe.stacked_experts
