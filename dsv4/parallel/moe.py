"""Expert-parallel MoE: rank r of W holds the routed experts e with e % W == r, and a 1/W slice
of the shared expert's intermediate dimension (docs/model.md#moe).

Every rank routes every token with the replicated gate (same weights, same inputs, so the same
weights and ids on all ranks), runs its own experts on the tokens routed to them and its shared
slice on all tokens, and the fp32 partial sums [T, D] are all-reduced once per layer.
No token moves between ranks: this is the all-reduce form of EP (no all-to-all dispatch).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.errors import ConfigError
from dsv4.model.moe import Expert, MoE, stack_experts_
from dsv4.parallel.attention import rank_slice, sliced_param
from dsv4.parallel.group import ParallelGroup


def local_expert_ids(num_experts: int, group: ParallelGroup) -> list[int]:
    """The routed experts this rank holds (round-robin: e % world == rank)."""
    return list(range(group.rank, num_experts, group.world_size))


def local_expert_pairs(
    weights: torch.Tensor, ids: torch.Tensor, group: ParallelGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed pairs (weights [T, K] fp32, global expert ids [T, K]) -> the same pairs on this
    rank's stacked experts: expert e (held by rank e % W) is its slot e // W. A pair of another
    rank's expert gets id -1 and weight 0: `moe_experts(..., skip=True)` computes no tile for it
    and adds nothing, so a rank's GEMMs cost its own pairs only (~1/W of the routed work).
    No host sync (CUDA-graph capturable)."""
    world = group.world_size
    owned = ids % world == group.rank
    slots = torch.where(owned, ids // world, torch.full_like(ids, -1))
    return torch.where(owned, weights, torch.zeros_like(weights)), slots


def sharded_shared_expert(shared: Expert, group: ParallelGroup) -> Expert:
    """The rank's slice of an expert (the shared one, or a routed one without EP): w1/w3 rows and w2 columns of its share of the
    intermediate dimension. SwiGLU is elementwise there, so the slices' outputs sum exactly to
    the full expert's output (up to fp rounding)."""
    inter, dim = shared.w1.weight.shape
    cols = rank_slice(inter, group)
    with torch.device("meta"):
        part = Expert(dim, cols.stop - cols.start, shared.limit)
    part.w1.weight = sliced_param(shared.w1.weight, cols)  # [I/W, D]
    part.w3.weight = sliced_param(shared.w3.weight, cols)  # [I/W, D]
    part.w2.weight = sliced_param(shared.w2.weight, slice(None), cols)  # [D, I/W]
    return part


class ExpertParallelMoE(MoE):
    """`MoE` holding this rank's experts; its output is all-reduced (fp32) across the group.

    `expert_parallel` False (tensor-parallel experts): every routed expert is kept, sliced
    like the shared expert (w1/w3 rows, w2 columns of the rank's 1/W of the intermediate dim).

    `experts` is an `nn.ModuleDict` keyed by the global expert id, so state-dict names stay the
    checkpoint's (`ffn.experts.{e}.w1.weight`) for the experts this rank holds. The routed
    experts are the original modules (no copy); the others are dropped with the original MoE.
    """

    def __init__(
        self, moe: MoE, layer_id: int, group: ParallelGroup, *, expert_parallel: bool = True
    ) -> None:
        if moe.expert_store is not None:
            raise ConfigError(
                "expert offload", "on", "expert offload cannot be combined with expert "
                "parallelism: turn one of them off"
            )  # fmt: skip
        if moe.stacked_experts is not None and moe.stacked_experts.is_quantized:
            raise ConfigError("features.expert_weights", "checkpoint", "expert parallelism "
                              "shards expert modules: load the experts as bf16")  # fmt: skip
        # Skeleton without allocation; gate, experts and shared expert are replaced below.
        with torch.device("meta"):
            super().__init__(moe.cfg, layer_id)
        self.group = group
        self.gate = moe.gate  # replicated: routing is identical on every rank
        if expert_parallel:
            held = {str(e): moe.experts[e] for e in local_expert_ids(len(moe.experts), group)}
        else:  # tensor-parallel experts: every expert, each one's intermediate slice
            held = {str(e): sharded_shared_expert(x, group) for e, x in enumerate(moe.experts)}
        self.experts = nn.ModuleDict(held)
        self.shared_experts = None
        if moe.shared_experts is not None:
            self.shared_experts = sharded_shared_expert(moe.shared_experts, group)
        if moe.stacked_experts is not None:  # the held experts are views of all E: restack
            stack_experts_(self)  # them alone, so the full storage goes with `moe`

    def forward(self, u: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """u [..., D] (ffn_norm applied), token_ids [...] -> [..., D], the same on every rank
        (collective: all ranks must call, with the same inputs)."""
        if self.expert_store is not None:
            raise ConfigError("expert offload", "on", "not supported with expert parallelism")
        shape = u.shape
        flat = u.reshape(-1, shape[-1])  # [T, D]
        weights, ids = self.gate(flat, token_ids.reshape(-1))  # [T, K] on every rank
        out = torch.zeros(flat.shape, dtype=torch.float32, device=u.device)  # [T, D] partial
        # NOTE: same per-expert dispatch and fp32 accumulation order as MoE.forward, restricted
        # to the local experts, so world size 1 reproduces it bit for bit.
        for e in ids.unique().tolist():
            if str(e) not in self.experts:
                continue  # another rank's expert
            expert = self.experts[str(e)]
            token_idx, slot = torch.where(ids == e)
            y = expert(flat[token_idx]).float() * weights[token_idx, slot].unsqueeze(-1)
            out.index_add_(0, token_idx, y)
        if self.shared_experts is not None:
            out += self.shared_experts(flat).float()  # this rank's intermediate slice
        return self.group.all_reduce_fp32(out).to(u.dtype).view(shape)
