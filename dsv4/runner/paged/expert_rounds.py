"""A step whose cold experts may not all fit a layer's cache slots at once (a prefill): the
pool's GEMM in rounds (docs/architecture.md#expert-pool).

Round 0 takes every expert already on the device and as many misses as the slots those leave;
each later round the next S misses (ascending ids). A round resolves only its experts' pairs
(the others are skipped, -1), so its fetches evict nothing it uses, and computes their rows
into the one per-pair buffer [T*K, D]; one combine at the end sums each token's rows in the
resident path's order, so the output is the all-resident one bit for bit. Eager only: the
split reads the routing and the slot table on the host (a sync a captured graph cannot hold).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsv4.errors import ExpertPoolError

if TYPE_CHECKING:
    from dsv4.runner.paged.expert_pool import LayerPool


def round_groups(used: list[int], table: list[int], num_resident: int,
                 num_slots: int) -> list[list[int]]:  # fmt: skip
    """The logical experts of each round (see the module doc); `table` [E] the slot table."""
    on_device = [e for e in used if table[e] >= 0]
    misses = [e for e in used if table[e] < 0]
    if misses and num_slots == 0:
        raise ExpertPoolError("expert pool: a layer with cold experts has no cache slot")
    free = num_slots - sum(table[e] >= num_resident for e in on_device)
    groups = [on_device + misses[:free]]
    groups += [misses[i : i + num_slots] for i in range(free, len(misses), max(num_slots, 1))]
    return [g for g in groups if g]


def experts_in_rounds(pool: LayerPool, u: torch.Tensor, ids: torch.Tensor,
                      weights: torch.Tensor, limit: float | None) -> torch.Tensor:  # fmt: skip
    """`LayerPool.experts` for a step too large for one round: y [T, D] fp32."""
    if u.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ExpertPoolError(f"expert pool: a captured step of {ids.numel()} pairs exceeds "
                              f"{pool.num_slots} cache slots (max_decode_tokens too small)")  # fmt: skip
    used = ids.unique().tolist()  # host sync: this is an eager (prefill) step
    groups = round_groups(used, pool.table.tolist(), pool.num_resident, pool.num_slots)
    rows = None
    for group in groups:
        part = torch.isin(ids, torch.tensor(group, dtype=ids.dtype, device=ids.device))
        rows_of = pool.resolve(torch.where(part, ids, -1))
        rows = pool.rows(u, rows_of, limit, out=rows, skip=True)
    assert rows is not None
    return pool.ops["combine_rows"](rows, weights, ids)
