"""A prefill's cold experts through one shared staging buffer (`features.expert_staging`,
docs/architecture.md#expert-staging).

A prefill-sized step routes to nearly every expert of a layer, so its misses (the layer's cold
experts) far outnumber the cache slots, which are sized for a decode step (max batch x top-k:
6 at batch 1). In rounds through the slots (`expert_rounds.py`) that is tens of rounds a layer,
each a copy, a slot-table update and a GEMM launch over all the step's pairs. Here the pool
instead owns one staging storage of N experts for all layers (layers run one after another),
used in two halves of N/2: the step first computes the pairs whose experts are on the device
(resident or cached), then the misses in groups of N/2, group g copied into half g % 2 on the
pool's copy stream while the compute stream runs group g - 1's GEMM.

Across layers: a step that missed at least half of a layer's cold experts (a long prompt) will
miss nearly all of the next layer's too, so once its last group's GEMM is launched the copy
stream fills both halves with the next layer's first N cold experts (not cached in its slots)
while the compute stream finishes this layer and runs the next one's attention. That layer
then uses what it needs of them (`Ahead`) and copies only the rest; an unused guess costs its
bytes, never a wrong row (rows are placed only for the step's own misses).

Each group's GEMM is `expert_rows` on the staging rows with num_experts = E and every pair of
the step passed (others skipped), so tiles, paths and per-pair sums are the all-resident
call's: one combine at the end gives the all-resident output bit for bit, as rounds do. The
slot table is not touched: a prefill does not evict the decode steps' cached experts. Eager
only (the split reads the routing on the host).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsv4.errors import ExpertPoolError
from dsv4.ops.expert_slots import COUNTER_NAMES

if TYPE_CHECKING:
    from dsv4.model.moe import ExpertWeights
    from dsv4.runner.paged.expert_pool import LayerPool

_HITS, _CACHE_HITS, _FETCHES, _BYTES, _PREFETCHES = (
    COUNTER_NAMES.index(n)
    for n in ("resident_hits", "cache_hits", "fetches", "bytes_fetched", "prefetches")
)


@dataclass(frozen=True)
class Group:
    """Experts copied into one half: `fetched[j]` at staging row half * N/2 + j; `ahead`:
    copied by the previous layer's step."""

    half: int
    fetched: tuple[int, ...]
    ahead: bool = False


@dataclass(frozen=True)
class Ahead:
    """The groups copied for `pool`'s next staged step (see the module doc)."""

    pool: LayerPool
    groups: tuple[Group, ...]


class Staging:
    """The shared staging storage ([N] rows in the pools' format) and its double buffering:
    `copied[h]` is recorded on the copy stream once half h holds its group, `freed[h]` on the
    compute stream once the GEMM that read half h is launched after it (CUDA only)."""

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
        """Row copies from pinned host memory, which CUDA runs on its copy engine (DMA): unlike
        the slots' copy kernel (whose rows only the device knows, inside captured graphs), they
        take no SM from the GEMMs running beside them. A run of consecutive host rows is one
        copy a part where the host part is contiguous; rows adopted from the offload store are
        strided views of its blobs, one copy a row and part."""
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

    def groups(self, misses: list[int], ahead: tuple[Group, ...]) -> list[Group]:
        """The step's groups: those copied ahead first, then the misses they do not hold in
        groups of N/2, alternating halves after them."""
        held = {e for g in ahead for e in g.fetched}
        rest = [e for e in misses if e not in held]
        first = (ahead[-1].half + 1) % 2 if ahead else self.next_half
        chunks = [tuple(rest[i : i + self.half]) for i in range(0, len(rest), self.half)]
        return [*ahead, *(Group((first + g) % 2, c) for g, c in enumerate(chunks))]


def next_ahead(pool: LayerPool, staging: Staging, groups: list[Group], num_misses: int,
               num_pairs: int) -> Ahead | None:  # fmt: skip
    """The groups to copy for the layer after `pool` once this step's `groups` are launched,
    when this step missed at least half of `pool`'s cold experts and the next layer stages
    too: its first N cold experts that its slots do not hold (read now, while the stream is
    idle), from the half after this step's last group."""
    owner = pool.owner_pool
    if owner is None or 2 * num_misses < pool.num_cold or pool.index + 1 >= len(owner.layers):
        return None
    nxt = owner.layers[pool.index + 1]
    if not nxt.num_slots or not nxt.stages(num_pairs):
        return None  # a layer that never runs (no slots) or needs no staging
    table = nxt.table.tolist()
    cold = [e for e in nxt.cold_rows if table[e] < 0][: 2 * staging.half]
    first = (groups[-1].half + 1) % 2 if groups else staging.next_half
    half = staging.half
    chunks = [tuple(cold[i : i + half]) for i in range(0, len(cold), half)]
    groups = tuple(Group((first + g) % 2, c, ahead=True) for g, c in enumerate(chunks))
    return Ahead(nxt, groups) if groups else None


def experts_staged(pool: LayerPool, staging: Staging, u: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor, limit: float | None) -> torch.Tensor:  # fmt: skip
    """`LayerPool.experts` of a step too large for one round, through `staging`: u [T, D],
    ids [T, K] logical, weights [T, K] fp32 -> y [T, D] fp32 (see the module doc)."""
    if u.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ExpertPoolError(f"expert pool: a captured step of {ids.numel()} pairs exceeds "
                              f"{pool.num_slots} cache slots (max_decode_tokens too small)")  # fmt: skip
    pool.join_prefetch()  # the table is read below: a prefetch may still be writing it
    table = pool.table.tolist()
    used = ids.unique().tolist()  # host sync: this is an eager (prefill) step
    ahead, staging.ahead = staging.ahead, None
    copied = ahead.groups if ahead is not None and ahead.pool is pool else ()
    on_device = [e for e in used if table[e] >= 0]
    misses = [e for e in used if table[e] < 0]
    groups = staging.groups(misses, copied)
    miss_set = set(misses)
    # [(expert, row in its half)] of each group: only the step's misses get a row
    placed = [[(e, j) for j, e in enumerate(g.fetched) if e in miss_set] for g in groups]
    from_ahead = sum(len(p) for p, g in zip(placed, groups, strict=True) if g.ahead)
    counts = pool.counters
    counts[_HITS] += sum(table[e] < pool.num_resident for e in on_device)
    # an expert copied ahead counts as a prefetched one does: a cache hit (its bytes were
    # counted when the copy was issued)
    counts[_CACHE_HITS] += sum(table[e] >= pool.num_resident for e in on_device) + from_ahead
    counts[_FETCHES] += len(misses) - from_ahead
    counts[_BYTES] += (len(misses) - from_ahead) * pool.row_bytes
    following = next_ahead(pool, staging, groups, len(misses), ids.numel())
    # every index tensor now, while the stream is idle after the host reads above: no further
    # host syncs between the GEMMs below
    device, long = ids.device, dict(dtype=torch.long, device=ids.device)
    group_ids = [torch.tensor([e for e, _ in p], **long) for p in placed]
    group_rows = [torch.tensor([g.half * staging.half + j for _, j in p], dtype=torch.int32,
                               device=device) for p, g in zip(placed, groups, strict=True)]  # fmt: skip
    on_device_ids = torch.tensor(on_device, **long)
    for g in range(min(2, len(groups))):  # both halves' copies start before any GEMM
        if not groups[g].ahead:
            staging.fill(pool, groups[g])
    # the pairs whose experts are on the device, in their storage rows; the rest skipped
    rows = pool.rows(u, pool.table[ids.long()], limit, skip=True,
                     used_rows=pool.table[on_device_ids])  # fmt: skip
    place = torch.full((pool.num_experts,), -1, dtype=torch.int32, device=device)
    sw = staging.weights
    for g, group in enumerate(groups):
        if g >= 2:  # this half's previous group has been read: refill it
            staging.fill(pool, group)
        if placed[g]:
            _wait_copy(pool, staging, group.half)
            place.fill_(-1)
            place[group_ids[g]] = group_rows[g]
            rows = pool.ops["expert_rows"](u, place[ids.long()], sw.w13, sw.w2, sw.format,
                                           sw.w13_scale, sw.w2_scale, limit, rows=rows,
                                           num_experts=pool.num_experts, skip=True,
                                           used_rows=group_rows[g])  # fmt: skip
        if staging.copy_stream is not None:
            staging.freed[group.half].record()
    if groups:
        staging.next_half = (groups[-1].half + 1) % 2
    if following is not None:
        _copy_ahead(staging, following)
    return pool.ops["combine_rows"](rows, weights, ids)


def _copy_ahead(staging: Staging, ahead: Ahead) -> None:
    """Start the next layer's copies (each after the GEMM that last read its half), counted
    on that layer as prefetches."""
    for group in ahead.groups:
        staging.fill(ahead.pool, group)
    n = sum(len(g.fetched) for g in ahead.groups)
    ahead.pool.counters[_PREFETCHES] += n
    ahead.pool.counters[_BYTES] += n * ahead.pool.row_bytes
    staging.ahead = ahead


def _wait_copy(pool: LayerPool, staging: Staging, h: int) -> None:
    """The compute stream waits for half h's copy, timed into the layer's `copy_wait_ns`
    (on CPU the copy ran in order: nothing to wait for)."""
    if staging.copy_stream is None:
        return
    pool.ops["copy_wait_start"](pool.counters)
    torch.cuda.current_stream(staging.weights.w13.device).wait_event(staging.copied[h])
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
