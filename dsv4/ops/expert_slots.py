"""The expert pool's slot table (docs/architecture.md#expert-pool): references of the kernels
of `kernels/expert_slots.py`, torch only.

A MoE layer's pool holds R resident experts in device rows [0, R) and S cache slots in rows
[R, R + S); the cold experts live in a host storage, one row each (`cold_row[e]`). State, all
on the device so a captured CUDA graph can update it:
- table [E] int32: logical expert -> device row, -1 = not on the device;
- owner [R + S] int32: device row -> logical expert, -1 = an empty cache slot;
- last_used [S] int64: the step a cache slot was last used (its LRU age);
- counters [COUNTERS] int64 of the layer: COUNTER_NAMES below (the step, the error bits).

`resolve_slots` maps a step's routed ids to device rows. The misses (experts used this step
that are not on the device), ascending by id, take the evictable cache slots (empty first,
then least recently used, then by index; never one whose expert this step uses) in that
order; `fetch[j]` names the host row to copy into slot R + j (-1: none). `copy_fetched` then
copies those rows. Both are deterministic, so the kernels equal these references exactly.

`prefetch_slots` is the same placement for a *predicted* routing of the layer (pre-gating:
the next layer's router on this layer's hidden state; a hash layer's exact experts), run
ahead of the layer on a copy stream: its misses take slots as far as they go (no overflow
error: a prediction is a hint), it counts `prefetches` instead of hits / fetches, and it
stamps its slots with the coming step (`step + 1`) without advancing the step, so the layer's
own `resolve_slots` sees them as just used and finds the experts it was predicted to use.

`copy_wait_start` / `copy_wait_end` time the compute stream's waits for expert copies into
`copy_wait_ns`: start stamps a clock into the row's `copy_wait_mark`, end adds the time since
that stamp (the kernels read the GPU's global nanosecond timer when they run, so they time
the stream inside a captured graph too). These references have no GPU timer and no streams:
they read the host's monotonic clock when called, so on the CPU, where every op runs to its
end before the next starts, they time the critical copy itself (`copy_fetched` between the
two); on a GPU they would time only the launches (use the kernels there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

COUNTER_NAMES = ("resident_hits", "cache_hits", "fetches", "bytes_fetched", "step", "errors",
                 "prefetches", "copy_wait_ns", "copy_wait_mark")  # fmt: skip
COUNTERS = 10  # a row of int64 per layer (one spare)
STEP, ERRORS = COUNTER_NAMES.index("step"), COUNTER_NAMES.index("errors")
PREFETCHES = COUNTER_NAMES.index("prefetches")  # experts copied ahead of their layer
# nanoseconds the compute stream waited for this layer's copies (a sum), and the clock stamp
# where the current wait began (a time, not a count: never summed)
COPY_WAIT_NS = COUNTER_NAMES.index("copy_wait_ns")
COPY_WAIT_MARK = COUNTER_NAMES.index("copy_wait_mark")
# error bits (counters[ERRORS], kept until ExpertPool.check clears them): the step's experts did not all reach the device
ERR_OVERFLOW = 1  # more misses than evictable cache slots (the pool was sized too small)
ERR_STALE = 2  # table[e] names a row whose owner is not e
ERR_NO_HOST_ROW = 4  # a miss for an expert without a host row (a resident one lost)
# LRU ages saturate here (keys are int32: evictable bit << 29 | (MAX_AGE - age) << 9 | slot)
MAX_AGE = (1 << 20) - 1
MAX_SLOTS = 512


def error_text(bits: int) -> str:
    """The error bits of a counters row, in words."""
    names = {ERR_OVERFLOW: "more misses than cache slots", ERR_STALE: "a stale slot table",
             ERR_NO_HOST_ROW: "a miss with no host copy"}  # fmt: skip
    return ", ".join(text for bit, text in names.items() if bits & bit) or "none"


@dataclass(frozen=True)
class SlotTable:
    """One layer's slot state (see the module doc), updated in place by `resolve_slots`."""

    table: torch.Tensor  # [E] int32
    owner: torch.Tensor  # [R + S] int32
    last_used: torch.Tensor  # [S] int64
    cold_row: torch.Tensor  # [E] int32
    counters: torch.Tensor  # [COUNTERS] int64
    fetch: torch.Tensor  # [S] int32: the host row each cache slot receives this step, or -1
    num_resident: int
    row_bytes: int  # one expert's bytes, every part (bytes_fetched counts these)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.table, self.owner, self.last_used, self.cold_row, self.counters, self.fetch


def resolve_slots_ref(ids: torch.Tensor, slots: SlotTable) -> torch.Tensor:
    """ids [T, K] logical experts (-1: a pair this call skips) -> device rows [T, K] int32 (-1
    for skipped pairs). Updates table, owner, last_used, counters and writes fetch [S] in place
    (see the module doc). A pair whose expert could not be placed reads row 0 and sets an error
    bit: the step's output is then refused (`ExpertPool.check`), never served."""
    return _place(ids, slots, prefetch=False)


def prefetch_slots_ref(ids: torch.Tensor, slots: SlotTable) -> None:
    """Place the experts of a predicted routing ids [T, K] (-1: none) ahead of the layer's
    step: writes fetch [S] (for `copy_fetched`) and the table, owners and stamps in place;
    counts `prefetches` and their bytes (see the module doc)."""
    _place(ids, slots, prefetch=True)


def _place(ids: torch.Tensor, slots: SlotTable, prefetch: bool) -> torch.Tensor:
    table, owner, last_used, cold_row, counters, fetch = slots.tensors
    num_experts, num_slots, r = table.numel(), fetch.numel(), slots.num_resident
    flat = ids.reshape(-1).long()
    valid = flat >= 0
    experts = torch.arange(num_experts, device=ids.device)
    used = torch.zeros(num_experts, dtype=torch.bool, device=ids.device)
    used[flat[valid]] = True
    before = table.long()
    on_dev = before >= 0
    stale = used & on_dev & (owner.long()[before.clamp(min=0)] != experts)
    miss = used & ~on_dev
    no_host = miss & (cold_row < 0)
    slot_owner = owner[r : r + num_slots].long()
    owner_used = (slot_owner >= 0) & used[slot_owner.clamp(min=0)]
    evictable = ~owner_used
    step = counters[STEP] + 1
    age = torch.where(slot_owner < 0, MAX_AGE, (step - last_used).clamp(0, MAX_AGE))
    j = torch.arange(num_slots, device=ids.device)
    key = (~evictable).long() << 29 | (MAX_AGE - age) << 9 | j
    by_rank = torch.argsort(key)  # evictable slots first, then oldest first, then by index
    missed = torch.nonzero(miss).flatten()  # ascending ids
    n_assign = min(missed.numel(), int(evictable.sum()))
    taken, new = by_rank[:n_assign], missed[:n_assign]
    old = slot_owner[taken]
    fetch.fill_(-1)
    fetch[taken] = cold_row[new].to(fetch.dtype)
    last_used[owner_used] = step
    last_used[taken] = step
    table[old[old >= 0]] = -1
    table[new] = (r + taken).to(table.dtype)
    owner[r + taken] = new.to(owner.dtype)
    counters[3] += n_assign * slots.row_bytes
    if prefetch:  # a hint: no hits counted, no overflow, the step not advanced
        counters[PREFETCHES] += n_assign
        counters[ERRORS] |= ERR_STALE * int(stale.any()) + ERR_NO_HOST_ROW * int(no_host.any())
        return ids
    counters[0] += (used & on_dev & (before < r)).sum()
    counters[1] += (used & on_dev & (before >= r)).sum()
    counters[2] += n_assign
    counters[STEP] = step
    errors = ERR_OVERFLOW * int(missed.numel() > n_assign) + ERR_STALE * int(stale.any())
    counters[ERRORS] |= errors + ERR_NO_HOST_ROW * int(no_host.any())
    rows = table.long()[flat.clamp(min=0)]
    rows = torch.where(valid & (rows < 0), 0, rows)  # unplaced: row 0, flagged above
    return torch.where(valid, rows, -1).to(torch.int32).view(ids.shape)


def copy_fetched_ref(
    fetch: torch.Tensor,
    dst: tuple[torch.Tensor, ...],
    src: tuple[torch.Tensor, ...],
    num_resident: int,
) -> None:
    """dst[i][R + j] = src[i][fetch[j]] for every cache slot j with fetch[j] >= 0: each part
    (w13, w2 and their scales) of the fetched cold experts, a plain row copy."""
    slots = torch.nonzero(fetch >= 0).flatten()
    rows = fetch[slots].long()
    for d, s in zip(dst, src):  # as bytes: index_put has no float8_e8m0fnu
        bytes_of = lambda t: t.view(torch.uint8)  # noqa: E731
        bytes_of(d)[num_resident + slots] = bytes_of(s)[rows.to(s.device)].to(d.device)


def copy_wait_start_ref(counters: torch.Tensor) -> None:
    """counters [COUNTERS] int64: a wait for copies begins now (`copy_wait_mark` = the host's
    monotonic clock, ns; see the module doc for what this clock times)."""
    counters[COPY_WAIT_MARK] = time.monotonic_ns()


def copy_wait_end_ref(counters: torch.Tensor, fetch: torch.Tensor | None = None) -> None:
    """counters [COUNTERS] int64: `copy_wait_ns` += now - `copy_wait_mark`. With fetch [S]
    int32 (the slots `copy_fetched` just filled), only if it copied a row: a step whose
    experts were all on the device waited for no copy."""
    waited = time.monotonic_ns() - counters[COPY_WAIT_MARK]
    if fetch is not None:  # on the device, no host sync: a zero when nothing was copied
        waited = waited * (fetch >= 0).any()
    counters[COPY_WAIT_NS] += waited
