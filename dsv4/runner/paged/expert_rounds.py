"""A step whose cold experts may not all fit a layer's cache slots at once (a prefill): the
pool's GEMM in rounds (docs/architecture.md#expert-pool).

Round 0 takes every expert already on the device and as many misses as the slots those leave;
each later round the next S misses (ascending ids). A round resolves only its experts' pairs
(the others are skipped, -1), so its fetches evict nothing it uses, and computes their rows
into the one per-pair buffer [T*K, D]; one combine at the end sums each token's rows in the
resident path's order, so the output is the all-resident one bit for bit. A round names its
storage rows to the GEMM (`used_rows`): a prefill-sized MXFP4 step dequantises only those to
its bf16 scratch, not every resident row and slot each round (with 169 resident and 24 slots,
a later round's 24 experts instead of 193). Eager only: the
split reads the routing and the slot table on the host (a sync a captured graph cannot hold).

Double-buffered (`lookahead`, with `features.expert_prefetch`): rounds take S // 2 misses, and
right after round i is resolved, round i + 1's misses are prefetched on the pool's copy stream
(`LayerPool.prefetch` of both rounds' pairs, so round i's slots are never evicted) while round
i's GEMM runs; round i + 1's resolve then finds them in place. Same rows, same combine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsv4.errors import ExpertPoolError

if TYPE_CHECKING:
    from dsv4.runner.paged.expert_pool import LayerPool


def round_groups(used: list[int], table: list[int], num_resident: int,
                 num_slots: int, halves: bool = False) -> list[list[int]]:  # fmt: skip
    """The logical experts of each round (see the module doc); `table` [E] the slot table;
    `halves`: each round's misses fit half the slots (double buffering)."""
    on_device = [e for e in used if table[e] >= 0]
    misses = [e for e in used if table[e] < 0]
    if misses and num_slots == 0:
        raise ExpertPoolError("expert pool: a layer with cold experts has no cache slot")
    per_round = num_slots // 2 if halves and num_slots >= 2 else num_slots
    cached = sum(table[e] >= num_resident for e in on_device)
    free = max(0, per_round - cached) if per_round < num_slots else num_slots - cached
    groups = [on_device + misses[:free]]
    groups += [misses[i : i + per_round] for i in range(free, len(misses), max(per_round, 1))]
    return [g for g in groups if g]


def experts_in_rounds(pool: LayerPool, u: torch.Tensor, ids: torch.Tensor,
                      weights: torch.Tensor, limit: float | None,
                      lookahead: bool = False) -> torch.Tensor:  # fmt: skip
    """`LayerPool.experts` for a step too large for one round: y [T, D] fp32; `lookahead`:
    double-buffered rounds (see the module doc)."""
    if u.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ExpertPoolError(f"expert pool: a captured step of {ids.numel()} pairs exceeds "
                              f"{pool.num_slots} cache slots (max_decode_tokens too small)")  # fmt: skip
    pool.join_prefetch()  # the table is read below: a prefetch may still be writing it
    used = ids.unique().tolist()  # host sync: this is an eager (prefill) step
    groups = round_groups(used, pool.table.tolist(), pool.num_resident, pool.num_slots,
                          halves=lookahead)  # fmt: skip
    experts = [torch.tensor(g, dtype=torch.long, device=ids.device) for g in groups]
    parts = [torch.isin(ids, g.to(ids.dtype)) for g in experts]
    rows = None
    for i, part in enumerate(parts):
        rows_of = pool.resolve(torch.where(part, ids, -1))
        # the round's storage rows, read from the table its resolve just wrote (before a
        # prefetch changes it): a prefill-sized MXFP4 GEMM then dequantises these, not R + S
        # (clamped: a stale table's -1 reads row 0; the step fails through the error flag)
        used_rows = pool.table[experts[i]].clamp_(min=0)
        if lookahead and i + 1 < len(parts):  # round i + 1's misses beside round i's GEMM
            pool.prefetch(torch.where(part | parts[i + 1], ids, -1))
        rows = pool.rows(u, rows_of, limit, out=rows, skip=True, used_rows=used_rows)
    assert rows is not None
    return pool.ops["combine_rows"](rows, weights, ids)
