"""The prefill staging buffer of the expert pools (`features.expert_staging`,
docs/architecture.md#expert-staging): one device storage of N experts in the pools' format,
shared by all layers (layers run one after another), used as two halves of N/2.

A prefill-sized step routes to nearly every expert of a layer, so its misses (the layer's cold
experts) far outnumber the cache slots, which are sized for a decode step (max batch x top-k:
6 at batch 1). Instead of tens of rounds through the slots (`expert_rounds.py`), such a step
computes the pairs whose experts are on the device in place, then its cold experts in groups
of N/2 (`Group`), group g copied into half g % 2 on the pool's copy stream while the compute
stream runs group g - 1's GEMM (`expert_staging_steps.py` says which experts and when).

Copies are row copies from pinned host memory, which CUDA runs on its copy engine (DMA): a
prefill's rows are known on the host, so unlike the slots' copy kernel (whose rows only the
device knows, inside captured graphs, and which holds SMs while it waits on PCIe) they take no
SM from the GEMMs beside them. `copied[h]` is recorded on the copy stream once half h holds its
group, `freed[h]` on the compute stream once the GEMM that read half h is launched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsv4.ops.expert_slots import COUNTER_NAMES, PREFETCHES

if TYPE_CHECKING:
    from dsv4.model.moe import ExpertWeights
    from dsv4.runner.paged.expert_pool import LayerPool

_BYTES = COUNTER_NAMES.index("bytes_fetched")


@dataclass(frozen=True)
class Group:
    """Experts copied into one half: `fetched[j]` at staging row half * N/2 + j; `ahead`:
    copied by the previous layer's step."""

    half: int
    fetched: tuple[int, ...]
    ahead: bool = False


@dataclass(frozen=True)
class Ahead:
    """The groups copied for `pool`'s next staged step; `every_cold`: the first groups of
    its cold experts in order (a streamed step's own groups: `expert_staging_steps.py`)."""

    pool: LayerPool
    groups: tuple[Group, ...]
    every_cold: bool = False


class Staging:
    """The shared staging storage ([N] rows in the pools' format) and its double buffering."""

    def __init__(self, weights: ExpertWeights, copy_stream: torch.cuda.Stream | None) -> None:
        self.weights, self.copy_stream = weights, copy_stream
        self.parts = tuple(t for t in (weights.w13, weights.w2, weights.w13_scale,
                                       weights.w2_scale) if t is not None)  # fmt: skip
        self.byte_parts = _byte_rows(self.parts)
        self.half = weights.w13.shape[0] // 2
        self.next_half = 0
        self.ahead: Ahead | None = None  # what the halves hold for the next layer, if anything
        cuda = copy_stream is not None
        self.copied = [torch.cuda.Event() for _ in range(2)] if cuda else []
        self.freed = [torch.cuda.Event() for _ in range(2)] if cuda else []
        # a streamed group's device tensors, made once (layer, half, experts) -> (place [E]
        # int32: each expert's staging row or -1, rows [n] int32: the group's staging rows)
        self._placed: dict[tuple[int, Group], tuple[torch.Tensor, torch.Tensor]] = {}

    def fill(self, pool: LayerPool, group: Group) -> None:
        """Copy `group`'s experts from `pool`'s host rows into its half: on the copy stream once
        the half's last GEMM is done (CUDA), or in order, timed as the wait (CPU)."""
        if self.copy_stream is None:
            pool.ops["copy_wait_start"](pool.counters)
            self._copy(pool, group)
            pool.ops["copy_wait_end"](pool.counters)
            return
        self.copy_stream.wait_event(self.freed[group.half])
        with torch.cuda.stream(self.copy_stream):
            self._copy(pool, group)
            self.copied[group.half].record(self.copy_stream)

    def _copy(self, pool: LayerPool, group: Group) -> None:
        """A run of consecutive host rows is one copy a part where the host part is contiguous;
        rows adopted from the offload store are strided views of its blobs: one copy a row and
        part (asynchronous from pinned memory on CUDA)."""
        base = group.half * self.half
        rows = [pool.cold_rows[e] for e in group.fetched]
        for j, row, n in _runs(rows):
            for dst, src in zip(self.byte_parts, _byte_rows(pool.host), strict=True):
                into, out_of = dst[base + j : base + j + n], src[row : row + n]
                if out_of.is_contiguous():
                    into.copy_(out_of, non_blocking=True)
                    continue
                for i in range(n):
                    into[i].copy_(out_of[i], non_blocking=True)

    def groups(self, experts: list[int], ahead: tuple[Group, ...]) -> list[Group]:
        """A step's groups: those copied ahead first, then the `experts` they do not hold in
        groups of N/2, alternating halves after them."""
        held = {e for g in ahead for e in g.fetched}
        rest = [e for e in experts if e not in held]
        first = (ahead[-1].half + 1) % 2 if ahead else self.next_half
        return [*ahead, *self.chunks(rest, first)]

    def chunks(self, experts: list[int], first: int, ahead: bool = False) -> list[Group]:
        """`experts` in groups of N/2, the halves alternating from `first`."""
        n = self.half
        return [Group((first + g) % 2, tuple(experts[i : i + n]), ahead)
                for g, i in enumerate(range(0, len(experts), n))]  # fmt: skip

    def placed(self, pool: LayerPool, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
        """(place [E] int32, rows [n] int32) of a streamed group (see `_placed`)."""
        key = (pool.index, Group(group.half, group.fetched))
        if key not in self._placed:
            base, device = group.half * self.half, pool.table.device
            rows = list(range(base, base + len(group.fetched)))
            place = torch.full((pool.num_experts,), -1, dtype=torch.int32)
            place[list(group.fetched)] = torch.tensor(rows, dtype=torch.int32)
            self._placed[key] = (place.to(device), torch.tensor(rows, dtype=torch.int32).to(device))
        return self._placed[key]

    def copy_ahead(self, ahead: Ahead) -> None:
        """Start the next layer's copies (each after the GEMM that last read its half), counted
        on that layer as prefetches."""
        for group in ahead.groups:
            self.fill(ahead.pool, group)
        n = sum(len(g.fetched) for g in ahead.groups)
        ahead.pool.counters[PREFETCHES] += n
        ahead.pool.counters[_BYTES] += n * ahead.pool.row_bytes
        self.ahead = ahead

    def wait_copy(self, pool: LayerPool, h: int) -> None:
        """The compute stream waits for half h's copy, timed into the layer's `copy_wait_ns`
        (on CPU the copy ran in order: nothing to wait for)."""
        if self.copy_stream is None:
            return
        pool.ops["copy_wait_start"](pool.counters)
        torch.cuda.current_stream(self.weights.w13.device).wait_event(self.copied[h])
        pool.ops["copy_wait_end"](pool.counters)


def _byte_rows(parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Each part [rows, ...] as [rows, row bytes] uint8 views (rows contiguous, at any stride;
    float8_e8m0fnu scales have no copy kernel everywhere)."""
    return tuple(t.view(torch.uint8).view(t.shape[0], -1) for t in parts)


def _runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """(offset in `rows`, first row, length) of each run of consecutive rows."""
    out: list[tuple[int, int, int]] = []
    for j, row in enumerate(rows):
        if out and out[-1][1] + out[-1][2] == row:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((j, row, 1))
    return out
