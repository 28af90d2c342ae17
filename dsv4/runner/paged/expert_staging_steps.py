"""Which cold experts a prefill step copies through the staging buffer, and when
(`Staging`: expert_staging.py; docs/architecture.md#expert-staging).

By the step's size, T tokens x K experts each against a layer's E experts:
- **streamed** (T*K >= STREAM_PAIRS_PER_EXPERT * E, ~128 tokens of V4-Flash): such a step routes
  to ~95% of every layer's experts or more, so it copies every cold expert of the layer, in
  host-row order, and never reads its routing on the host. No host sync: the host runs ahead,
  layers after layers, and the copy engine never waits for it. Which pairs each group serves is
  decided on the device (an expert's staging row where the slot table misses it, else -1), and
  the counters are counted there too. The next layer's first N cold experts are copied as soon
  as the GEMMs that read their halves are done, beside the rest of this layer and the next
  one's attention.
- **routed** (smaller steps): one host read of the step's routing and the slot table, then only
  its misses in groups of N/2; when it missed at least half of the layer's cold experts, the
  next layer's first N cold experts that its slots do not hold are copied ahead.
The next layer uses what it needs of a copy ahead (`Ahead`) and copies the rest; an unused guess
costs its bytes, never a row: rows are placed only for the step's own misses, and a copy ahead
is trusted by its own layer only (another layer staging first drops it).

Each group's GEMM is `expert_rows` on the staging rows with num_experts = E and every pair of
the step passed (others skipped), so tiles, paths and per-pair sums are the all-resident
call's: one combine at the end gives the all-resident output bit for bit, as rounds do. The
slot table is not touched: a prefill does not evict the decode steps' cached experts. Eager
only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsv4.errors import ExpertPoolError
from dsv4.ops.expert_slots import COUNTER_NAMES
from dsv4.runner.paged.expert_staging import Ahead, Group, Staging

if TYPE_CHECKING:
    from dsv4.runner.paged.expert_pool import LayerPool

_HITS, _CACHE_HITS, _FETCHES, _BYTES = (
    COUNTER_NAMES.index(n) for n in ("resident_hits", "cache_hits", "fetches", "bytes_fetched")
)
# pairs per expert from which a step streams every cold expert: uniform routing then leaves an
# expert unrouted with probability e^-3 (5%); a smaller step reads its routing instead
STREAM_PAIRS_PER_EXPERT = 3


def experts_staged(pool: LayerPool, staging: Staging, u: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor, limit: float | None) -> torch.Tensor:  # fmt: skip
    """`LayerPool.experts` of a step too large for one round, through `staging`: u [T, D],
    ids [T, K] logical, weights [T, K] fp32 -> y [T, D] fp32 (see the module doc)."""
    if u.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ExpertPoolError(f"expert pool: a captured step of {ids.numel()} pairs exceeds "
                              f"{pool.num_slots} cache slots (max_decode_tokens too small)")  # fmt: skip
    pool.join_prefetch()  # the slot table is read below: a prefetch may still be writing it
    ahead, staging.ahead = staging.ahead, None
    mine = ahead if ahead is not None and ahead.pool is pool else None
    if streams(ids.numel(), pool.num_experts):
        rows = _streamed(pool, staging, u, ids, limit, mine)
    else:
        rows = _routed(pool, staging, u, ids, limit, mine)
    return pool.ops["combine_rows"](rows, weights, ids)


def streams(num_pairs: int, num_experts: int) -> bool:
    """A step of `num_pairs` pairs copies every cold expert (the streamed way)."""
    return num_pairs >= STREAM_PAIRS_PER_EXPERT * num_experts


def _streamed(pool: LayerPool, staging: Staging, u: torch.Tensor, ids: torch.Tensor,
              limit: float | None, ahead: Ahead | None) -> torch.Tensor:  # fmt: skip
    """Every cold expert through the halves, with no host read (module doc) -> rows [T*K, D]."""
    copied = ahead.groups if ahead is not None and ahead.every_cold else ()
    groups = staging.groups(list(pool.cold_rows), copied)
    table, flat = pool.table, ids.reshape(-1).long()
    used = torch.zeros(pool.num_experts, dtype=torch.bool, device=ids.device)
    used[flat] = True  # [E]: the experts this step routes to
    missed = used & (table < 0)
    from_ahead = torch.zeros_like(used)
    for group in copied:
        from_ahead |= staging.placed(pool, group)[0] >= 0
    counts = pool.counters
    counts[_HITS] += (used & (table >= 0) & (table < pool.num_resident)).sum()
    # a miss copied ahead counts as a prefetched expert does: a cache hit (its bytes were
    # counted when the copy was issued)
    counts[_CACHE_HITS] += (used & (table >= pool.num_resident)).sum() + (missed & from_ahead).sum()
    counts[_FETCHES] += (missed & ~from_ahead).sum()
    counts[_BYTES] += sum(len(g.fetched) for g in groups if not g.ahead) * pool.row_bytes
    for group in groups[:2]:  # both halves' copies start before any GEMM
        if not group.ahead:
            staging.fill(pool, group)
    # the pairs whose experts are on the device, in their storage rows; the rest skipped
    rows = pool.rows(u, table[flat].view(ids.shape), limit, skip=True)
    for g, group in enumerate(groups):
        if g >= 2:  # this half's previous group has been read: refill it
            staging.fill(pool, group)
        place, group_rows = staging.placed(pool, group)
        staging.wait_copy(pool, group.half)
        rows_of = torch.where(table < 0, place, -1)[flat].view(ids.shape)  # misses only
        rows = pool.rows(u, rows_of, limit, rows, skip=True, used_rows=group_rows,
                         storage=staging.weights)  # fmt: skip
        if staging.copy_stream is not None:
            staging.freed[group.half].record()
    _finish(pool, staging, groups, _stream_ahead(pool, staging, groups, ids.numel()))
    return rows


def _stream_ahead(pool: LayerPool, staging: Staging, groups: list[Group],
                  num_pairs: int) -> Ahead | None:  # fmt: skip
    """The next layer's first two groups when it streams too (no host read)."""
    nxt = _next_staged(pool, num_pairs)
    if nxt is None or not streams(num_pairs, nxt.num_experts):
        return None
    cold = list(nxt.cold_rows)[: 2 * staging.half]
    chunks = tuple(staging.chunks(cold, _half_after(staging, groups), ahead=True))
    return Ahead(nxt, chunks, every_cold=True) if chunks else None


def _routed(pool: LayerPool, staging: Staging, u: torch.Tensor, ids: torch.Tensor,
            limit: float | None, ahead: Ahead | None) -> torch.Tensor:  # fmt: skip
    """Only the step's misses, read on the host (module doc) -> rows [T*K, D]."""
    table = pool.table.tolist()
    used = ids.unique().tolist()  # host sync: this is an eager (prefill) step
    on_device = [e for e in used if table[e] >= 0]
    misses = [e for e in used if table[e] < 0]
    groups = staging.groups(misses, ahead.groups if ahead is not None else ())
    miss_set = set(misses)
    # [(expert, row in its half)] of each group: only the step's misses get a row
    placed = [[(e, j) for j, e in enumerate(g.fetched) if e in miss_set] for g in groups]
    from_ahead = sum(len(p) for p, g in zip(placed, groups, strict=True) if g.ahead)
    counts = pool.counters
    counts[_HITS] += sum(table[e] < pool.num_resident for e in on_device)
    counts[_CACHE_HITS] += sum(table[e] >= pool.num_resident for e in on_device) + from_ahead
    counts[_FETCHES] += len(misses) - from_ahead
    counts[_BYTES] += (len(misses) - from_ahead) * pool.row_bytes
    following = _routed_ahead(pool, staging, groups, len(misses), ids.numel())
    # every index tensor now, while the stream is idle after the host reads above: no further
    # host syncs between the GEMMs below
    device, long = ids.device, dict(dtype=torch.long, device=ids.device)
    group_ids = [torch.tensor([e for e, _ in p], **long) for p in placed]
    group_rows = [torch.tensor([g.half * staging.half + j for _, j in p], dtype=torch.int32,
                               device=device) for p, g in zip(placed, groups, strict=True)]  # fmt: skip
    on_device_ids = torch.tensor(on_device, **long)
    for group in groups[:2]:  # both halves' copies start before any GEMM
        if not group.ahead:
            staging.fill(pool, group)
    rows = pool.rows(u, pool.table[ids.long()], limit, skip=True,
                     used_rows=pool.table[on_device_ids])  # fmt: skip
    place = torch.full((pool.num_experts,), -1, dtype=torch.int32, device=device)
    for g, group in enumerate(groups):
        if g >= 2:
            staging.fill(pool, group)
        if placed[g]:
            staging.wait_copy(pool, group.half)
            place.fill_(-1)
            place[group_ids[g]] = group_rows[g]
            rows = pool.rows(u, place[ids.long()], limit, rows, skip=True,
                             used_rows=group_rows[g], storage=staging.weights)  # fmt: skip
        if staging.copy_stream is not None:
            staging.freed[group.half].record()
    _finish(pool, staging, groups, following)
    return rows


def _routed_ahead(pool: LayerPool, staging: Staging, groups: list[Group], num_misses: int,
                  num_pairs: int) -> Ahead | None:  # fmt: skip
    """When this step missed at least half of `pool`'s cold experts and the next layer stages
    too: its first N cold experts that its slots do not hold (its table read now, while the
    stream is idle)."""
    nxt = _next_staged(pool, num_pairs)
    if nxt is None or 2 * num_misses < pool.num_cold:
        return None
    table = nxt.table.tolist()
    cold = [e for e in nxt.cold_rows if table[e] < 0][: 2 * staging.half]
    chunks = tuple(staging.chunks(cold, _half_after(staging, groups), ahead=True))
    return Ahead(nxt, chunks) if chunks else None


def _next_staged(pool: LayerPool, num_pairs: int) -> LayerPool | None:
    """The layer after `pool` if the same step stages there too."""
    owner = pool.owner_pool
    if owner is None or pool.index + 1 >= len(owner.layers):
        return None
    nxt = owner.layers[pool.index + 1]
    # a layer with no slots never runs (the MTP layer without speculation)
    return nxt if nxt.num_slots and nxt.stages(num_pairs) else None


def _half_after(staging: Staging, groups: list[Group]) -> int:
    return (groups[-1].half + 1) % 2 if groups else staging.next_half


def _finish(pool: LayerPool, staging: Staging, groups: list[Group],
            following: Ahead | None) -> None:  # fmt: skip
    """After the step's last GEMM launch: the next step starts from the following half, and the
    next layer's copies ahead start now."""
    staging.next_half = _half_after(staging, groups)
    if following is not None:
        staging.copy_ahead(following)
