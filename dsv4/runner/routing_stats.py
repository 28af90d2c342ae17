"""Per-layer expert popularity, counted on the device as the model routes (expert residency).

`RoutingStats` holds `counts` [num_moe_layers, E] int64 on the model's device: row i is MoE
layer i of `model.layers`, then the MTP layer (when the model has one). Every routed choice
adds one to its (layer, expert) cell with `index_add_`, so counting needs no host sync and
runs inside a captured decode graph (replays count too).

Where the counts come from:
- the paged forward calls `record(moe, ids)` right after routing; `begin_step(t)` first
  builds the step's per-token weight (1 real, 0 padding): a captured decode step pads its batch
  with rows on the cache's scratch blocks (`dsv4.runner.paged.graphs`), whose block ids start at
  the cache's `num_blocks`, so a token counts iff its request's first block is below that;
- the reference forward has no padding: `observe(model)` installs `MoE.route_observer` (a
  tensor-parallel replica's sharded MoE does not report: count with the paged forward there,
  where rank 0 counts for the replica).

The host reads the counts only when asked (`snapshot`: a Prometheus scrape, a dump): one
device->host copy of L x E int64. `reset()` zeroes them in place (graphs keep the address).
"""

from __future__ import annotations

import functools

import torch

from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.model.moe import MoE
from dsv4.plan.residency import Residency
from dsv4.runner.paged.step_metadata import StepTensors


def moe_layers(model: DeepseekV4) -> tuple[MoE, ...]:
    """The model's MoE modules in counting order: the main layers, then the MTP layer."""
    return (*(b.ffn for b in model.layers), *(m.ffn for m in model.mtp))


class RoutingStats:
    """Owned by the engine's runner; written on the engine thread, read from any thread."""

    def __init__(self, moes: tuple[MoE, ...], device: torch.device, first_scratch_block: int):
        self.num_experts = moes[0].cfg.n_routed_experts
        self.counts = torch.zeros(len(moes), self.num_experts, dtype=torch.int64, device=device)
        self._rows = {id(m): i for i, m in enumerate(moes)}
        self.first_scratch_block = first_scratch_block
        self._valid: torch.Tensor | None = None  # [T] int64 of the step being run (paged)

    @classmethod
    def for_model(cls, model: DeepseekV4, first_scratch_block: int) -> RoutingStats:
        """`first_scratch_block`: the cache's `num_blocks` (scratch block ids start there)."""
        return cls(moe_layers(model), model.embed.weight.device, first_scratch_block)

    @property
    def num_layers(self) -> int:
        return self.counts.shape[0]

    def begin_step(self, t: StepTensors) -> None:
        """The step's token weights from its tensors: block_tables [B, nb], token_to_req [T]."""
        first = t.block_tables[t.token_to_req.long(), 0]  # [T] each token's first block
        self._valid = (first < self.first_scratch_block).to(torch.int64)

    def record(self, moe: MoE, ids: torch.Tensor) -> None:
        """Paged forward: routed ids [T, K] of `moe` in the step `begin_step` described."""
        valid = self._valid
        assert valid is not None and valid.shape[0] == ids.shape[0], "begin_step first"
        self.count(self._rows[id(moe)], ids, valid)

    def count(self, layer: int, ids: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """counts[layer, e] += #{(t, k): ids[t, k] = e, valid[t]}; ids [T, K], valid [T]."""
        if valid is None:
            ones = torch.ones(ids.numel(), dtype=torch.int64, device=ids.device)
        else:
            ones = valid.unsqueeze(1).expand(ids.shape).reshape(-1)
        self.counts[layer].index_add_(0, ids.reshape(-1).long(), ones)

    def observe(self, model: DeepseekV4) -> None:
        """Count the reference forward's routing: every MoE module reports its ids [T, K]."""
        for moe in moe_layers(model):
            moe.route_observer = functools.partial(self.count, self._rows[id(moe)])

    def reset(self) -> None:
        self.counts.zero_()

    def snapshot(self) -> list[list[int]]:
        """The counts on the host (one device->host copy)."""
        return self.counts.cpu().tolist()

    def residency(self) -> Residency:
        """The counts as a residency file's content (every expert resident: no plan yet)."""
        return Residency.from_counts(self.snapshot())
