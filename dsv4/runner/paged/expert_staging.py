"""A prefill's cold experts through one shared staging buffer (`features.expert_staging`,
docs/architecture.md#expert-pool).

A prefill-sized step routes to nearly every expert of a layer, so its misses (the layer's cold
experts) far outnumber the cache slots, which are sized for a decode step (max batch x top-k:
6 at batch 1). In rounds through the slots (`expert_rounds.py`) that is tens of rounds a layer,
each a copy, a slot-table update and a GEMM launch over all the step's pairs. Here the pool
instead owns one staging storage of N experts for all layers (layers run one after another),
used in two halves of N/2: the step first computes the pairs whose experts are on the device
(resident or cached), then the misses in groups of N/2, group g copied into half g % 2 on the
pool's copy stream while the compute stream runs group g - 1's GEMM. The halves alternate
across layers too, so a layer's first copy never waits for the previous layer's last GEMM.

Each group's GEMM is `expert_rows` on the staging rows with num_experts = E and every pair of
the step passed (others skipped), so tiles, paths and per-pair sums are the all-resident
call's: one combine at the end gives the all-resident output bit for bit, as rounds do. The
slot table is not touched: a prefill does not evict the decode steps' cached experts. Eager
only (the split reads the routing on the host).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsv4.errors import ExpertPoolError
from dsv4.ops.expert_slots import COUNTER_NAMES

if TYPE_CHECKING:
    from dsv4.model.moe import ExpertWeights
    from dsv4.runner.paged.expert_pool import LayerPool

_HITS, _CACHE_HITS, _FETCHES, _BYTES = (
    COUNTER_NAMES.index(n) for n in ("resident_hits", "cache_hits", "fetches", "bytes_fetched")
)


class Staging:
    """The shared staging storage ([N] rows in the pools' format) and its double buffering:
    `copied[h]` is recorded on the copy stream once half h holds its group, `freed[h]` on the
    compute stream once the GEMM that read half h is launched after it (CUDA only)."""

    def __init__(self, weights: ExpertWeights, copy_stream: torch.cuda.Stream | None) -> None:
        self.weights, self.copy_stream = weights, copy_stream
        self.parts = tuple(t for t in (weights.w13, weights.w2, weights.w13_scale,
                                       weights.w2_scale) if t is not None)  # fmt: skip
        self.half = weights.w13.shape[0] // 2
        self.next_half = 0
        cuda = copy_stream is not None
        self.copied = [torch.cuda.Event() for _ in range(2)] if cuda else []
        self.freed = [torch.cuda.Event() for _ in range(2)] if cuda else []

    def fetch_list(self, pool: LayerPool, group: list[int], h: int) -> torch.Tensor:
        """The copy kernel's fetch list [N] int32 for the cold experts `group` (logical ids, at
        most N/2) in half h: their host rows at h * N/2.., -1 elsewhere."""
        fetch = [-1] * (2 * self.half)
        for j, e in enumerate(group):
            fetch[h * self.half + j] = pool.cold_rows[e]
        return torch.tensor(fetch, dtype=torch.int32, device=self.weights.w13.device)

    def fill(self, pool: LayerPool, fetch: torch.Tensor, h: int) -> None:
        """Copy the experts of `fetch` (`fetch_list`) into half h: on the copy stream once
        half h's last GEMM is done (CUDA), or in order, timed as the wait (CPU)."""
        if self.copy_stream is None:
            pool.ops["copy_wait_start"](pool.counters)
            pool.ops["copy_fetched"](fetch, self.parts, pool.host, 0)
            pool.ops["copy_wait_end"](pool.counters)
            return
        self.copy_stream.wait_event(self.freed[h])
        with torch.cuda.stream(self.copy_stream):
            pool.ops["copy_fetched"](fetch, self.parts, pool.host, 0)
            self.copied[h].record(self.copy_stream)
        fetch.record_stream(self.copy_stream)  # made on the compute stream, read here


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
    on_device = [e for e in used if table[e] >= 0]
    misses = [e for e in used if table[e] < 0]
    counts = pool.counters
    counts[_HITS] += sum(table[e] < pool.num_resident for e in on_device)
    counts[_CACHE_HITS] += sum(table[e] >= pool.num_resident for e in on_device)
    counts[_FETCHES] += len(misses)
    counts[_BYTES] += len(misses) * pool.row_bytes
    device, long = ids.device, dict(dtype=torch.long, device=ids.device)
    half, first = staging.half, staging.next_half
    groups = [misses[i : i + half] for i in range(0, len(misses), half)]
    halves = [(first + g) % 2 for g in range(len(groups))]
    # every index tensor now, while the stream is idle after the host read above: no further
    # host syncs between the GEMMs below
    fetches = [staging.fetch_list(pool, g, h) for g, h in zip(groups, halves, strict=True)]
    group_ids = [torch.tensor(g, **long) for g in groups]
    on_device_ids = torch.tensor(on_device, **long)
    for g in range(min(2, len(groups))):  # both halves' copies start before any GEMM
        staging.fill(pool, fetches[g], halves[g])
    # the pairs whose experts are on the device, in their storage rows; the rest skipped
    rows = pool.rows(u, pool.table[ids.long()], limit, skip=True,
                     used_rows=pool.table[on_device_ids])  # fmt: skip
    place = torch.full((pool.num_experts,), -1, dtype=torch.int32, device=device)
    sw = staging.weights
    for g, h in enumerate(halves):
        if g >= 2:  # this half's previous group has been read: refill it
            staging.fill(pool, fetches[g], h)
        _wait_copy(pool, staging, h)
        base = h * half
        used_rows = torch.arange(base, base + len(groups[g]), dtype=torch.int32, device=device)
        place.fill_(-1)
        place[group_ids[g]] = used_rows
        rows = pool.ops["expert_rows"](u, place[ids.long()], sw.w13, sw.w2, sw.format,
                                       sw.w13_scale, sw.w2_scale, limit, rows=rows,
                                       num_experts=pool.num_experts, skip=True,
                                       used_rows=used_rows)  # fmt: skip
        if staging.copy_stream is not None:
            staging.freed[h].record()
    staging.next_half = (first + len(groups)) % 2
    return pool.ops["combine_rows"](rows, weights, ids)


def _wait_copy(pool: LayerPool, staging: Staging, h: int) -> None:
    """The compute stream waits for half h's copy, timed into the layer's `copy_wait_ns`
    (on CPU the copy ran in order: nothing to wait for)."""
    if staging.copy_stream is None:
        return
    pool.ops["copy_wait_start"](pool.counters)
    torch.cuda.current_stream(staging.weights.w13.device).wait_event(staging.copied[h])
    pool.ops["copy_wait_end"](pool.counters)
