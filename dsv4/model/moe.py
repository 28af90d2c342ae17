"""Mixture of experts (DSV4_ARCH.md §8): every layer (and the MTP layer) is MoE.

Router: g = W_g u (fp32), s = sqrt(softplus(g)).
- hash layers (layer_id < num_hash_layers): experts = tid2eid[token id] (no bias);
- scored layers: experts = top-k of s + bias (the bias only selects).
Weights: the unbiased s of the chosen experts, renormalised, times routed_scaling_factor.
Experts are SwiGLU with the gate clamped above and the up-projection clamped to +-limit;
the shared expert is clamped too unless `cfg.clamp_shared_expert` is False (§16.1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.model.config import ModelConfig
from dsv4.model.layers import hot_op, linear, linear_fp32


@hot_op("route")
def route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    token_ids: torch.Tensor,
    tid2eid: torch.Tensor | None,
    top_k: int,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (weights [T, K] fp32, expert ids [T, K] int64).

    `tid2eid` [V, K] given: hash routing by token id; else top-k of scores + `bias`.
    """
    scores = F.softplus(logits).sqrt()  # [T, E]
    if tid2eid is not None:
        ids = tid2eid[token_ids].long()
    else:
        biased = scores if bias is None else scores + bias.float()
        ids = biased.topk(top_k, dim=-1).indices
    weights = scores.gather(-1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


class Gate(nn.Module):
    """`ffn.gate.weight` [E, D]; `.bias` [E] fp32 (scored) or `.tid2eid` [V, K] int64 (hash)."""

    def __init__(self, cfg: ModelConfig, is_hash: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.is_hash = is_hash
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
        return route(
            logits, self.bias, token_ids, table, cfg.num_experts_per_tok, cfg.routed_scaling_factor
        )


def swiglu(
    u: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, limit: float | None
) -> torch.Tensor:
    """w2(silu(min(w1 u, limit)) * clamp(w3 u, -limit, limit)); limit None = no clamp."""
    gate, up = F.linear(u, w1).float(), F.linear(u, w3).float()
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.linear((F.silu(gate) * up).to(u.dtype), w2)


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
        return swiglu(u, self.w1.weight, self.w2.weight, self.w3.weight, self.limit)


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
        self.stacked_experts: ExpertWeights | None = None  # set by `stack_experts_`

    def forward(self, u: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """u [..., D] (ffn_norm applied), token_ids [...] -> [..., D]."""
        shape = u.shape
        flat = u.reshape(-1, shape[-1])  # [T, D]
        weights, ids = self.gate(flat, token_ids.reshape(-1))  # [T, K]
        out = torch.zeros(flat.shape, dtype=torch.float32, device=u.device)
        store = self.expert_store
        if store is not None:
            store.prepare(ids)
        # NOTE: dispatch by expert (token lists per expert), fp32 accumulation; the order is
        # the same with a store, so offloaded outputs equal resident ones bit for bit.
        for e in ids.unique().tolist():
            token_idx, slot = torch.where(ids == e)
            expert = self.experts[e] if store is None else store.expert(e, token_idx.numel())
            y = expert(flat[token_idx]).float() * weights[token_idx, slot].unsqueeze(-1)
            out.index_add_(0, token_idx, y)
        if self.shared_experts is not None:
            out += self.shared_experts(flat).float()
        return out.to(u.dtype).view(shape)


@dataclass(frozen=True)
class ExpertWeights:
    """One MoE layer's routed experts in the grouped-GEMM layout of `kernels.moe`: w13
    [E, 2I, D] (rows [0, I) = w1 gate, [I, 2I) = w3 up) and w2 [E, D, I]. When the shared
    expert has a routed expert's shape, dtype and clamp it lives in slot E of the same storage
    (`w13_all` [E + 1, 2I, D], `w2_all`), so the grouped GEMM can run it as one more expert
    (`w13`, `w2` are then views of the first E slots)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_all: torch.Tensor | None = None
    w2_all: torch.Tensor | None = None


def _shares_layout(moe: MoE) -> bool:
    shared, first = moe.shared_experts, moe.experts[0]
    return (shared is not None and shared.w1.weight.shape == first.w1.weight.shape
            and shared.w1.weight.dtype == first.w1.weight.dtype
            and shared.limit == first.limit)  # fmt: skip


def stack_experts_(moe: MoE, device: torch.device | str | None = None) -> ExpertWeights:
    """Give the routed experts (and a same-shaped shared expert, in slot E) ONE stacked storage
    and re-point every expert's parameters at slices of it, so the weights exist once (the
    per-expert modules still work). Values are copied over, unless the experts are still on the
    meta device (a model being built: the storage is then allocated on `device` and filled by
    the caller). Kept on the module as `moe.stacked_experts`."""
    first = moe.experts[0].w1.weight
    inter, dim = first.shape
    device = first.device if device is None else torch.device(device)
    e = len(moe.experts)
    experts = [*moe.experts, *([moe.shared_experts] if _shares_layout(moe) else [])]
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
