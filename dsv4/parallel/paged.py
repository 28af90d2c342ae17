"""The paged forward's collectives for a replica of several ranks (`PagedCollectives` hooks).

Every rank runs `PagedForward` on its shard (`shard_model`) on the same step; the hooks make the
layers' outputs whole again, as `TensorParallelAttention` and `ExpertParallelMoE` do for the
reference forward:
- after attention: the fp32 all-reduce of the rank's heads' share of the output projection;
- after the MoE: the fp32 all-reduce of the rank's experts' share (and its shared-expert slice);
- with expert parallelism, right after routing: the routed pairs in this rank's expert slots
  (`local_expert_pairs`), the other ranks' pairs id -1 and weight 0, which the grouped GEMM
  skips (`skips_pairs`): each rank computes only its own experts' pairs.
Each all-reduce is bounded by the group timeout (`model.collective_timeout_s`), like the
reference forward's. CUDA graphs capture them only over NCCL (`can_capture`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.parallel.group import ParallelGroup
from dsv4.parallel.moe import local_expert_pairs
from dsv4.runner.paged.collectives import PagedCollectives


@dataclass(frozen=True)
class RankCollectives(PagedCollectives):
    """This rank's hooks."""

    group: ParallelGroup
    expert_parallel: bool

    @property
    def can_capture(self) -> bool:
        # gloo's all-reduce is a host call on host tensors: a CUDA graph cannot hold it
        return self.group.is_single or self.group.backend == "nccl"

    @property
    def skips_pairs(self) -> bool:
        return self.expert_parallel

    def after_attention(self, y: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce_fp32(y)

    def after_moe(self, y: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce_fp32(y)

    def local_experts(
        self, weights: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.expert_parallel:  # every expert on every rank, sliced: ids are slots
            return weights, ids
        return local_expert_pairs(weights, ids, self.group)


def rank_collectives(group: ParallelGroup, *, expert_parallel: bool) -> PagedCollectives:
    """The hooks for `group` (the identity `ONE_RANK` hooks' equal for one rank)."""
    if group.is_single:
        return PagedCollectives()
    return RankCollectives(group, expert_parallel)
