"""Where the paged forward meets the other ranks of a sharded model replica.

`PagedForward` runs the same layer loop on every rank of a replica, each on its shard
(`dsv4.parallel.shard`: the query heads and output groups of its share, its experts or its
slices of them). A sharded layer's output is then a partial sum, and with expert parallelism
the router picks experts this rank does not hold. The forward calls these hooks at exactly
those points:
- `after_attention(y)`: y [T, D], the rank's heads' share of the output projection;
- `after_moe(y)`: y [T, D] fp32, the rank's experts' (and shared-expert slice's) share;
- `local_experts(weights, ids)`: right after routing, (weights [T, K] fp32, ids [T, K] global
  expert ids) -> the same pairs on this rank's stacked experts; with `skips_pairs`, the pairs
  of experts other ranks hold come back as id -1 (weight 0) and the grouped GEMM skips them.
`ONE_RANK` is the identity; `dsv4.parallel.paged.RankCollectives` sums over the group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedCollectives:
    """One rank holds the whole model: every hook is the identity."""

    @property
    def can_capture(self) -> bool:
        """Whether a CUDA graph may capture the hooks (one rank: nothing to capture)."""
        return True

    @property
    def skips_pairs(self) -> bool:
        """Whether `local_experts` marks pairs to skip with id -1 (expert parallelism)."""
        return False

    def after_attention(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def after_moe(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def local_experts(
        self, weights: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return weights, ids


ONE_RANK = PagedCollectives()
