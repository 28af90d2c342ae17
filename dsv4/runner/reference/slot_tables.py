"""The reference forward's per-step slot tables (sparse-index metadata), built once and shared
by every layer of a kind (#45863, #47474; docs/model.md#per-step-metadata), and the gathers that
consume them. (The paged forward's own per-step tensors are `dsv4.runner.paged.step_metadata`;
the table builders themselves are the kernels of `kernels.metadata`.)

For the T tokens of a step (requests in order, each at positions start..end-1):
- `token_to_req` [T] int32: request index of every token, once per step (#47474);
- `window_slots` [T, W] int32: ring slots of the window positions max(0, p-W+1)..p of every
  token (valid first, then -1). Every layer's window ring has the same slot count R, and the
  ring is a block table whose every logical block maps to the same page of R slots, so the
  builder gets a zero block table of block size R: slot = p % R. Only the layer's region
  (ring block, byte offset) differs per layer;
- `entry_slots[r]` [T, N_r] int32 for r in (4, 128): "all visible compressed entries"
  i < (p+1)//r of every token as (token block, row) slots, slot = block_id * E + i % E with
  E = block_size // r. Shared by every ratio-r layer: its compressed pages, and for r = 4 its
  indexer pages, which hold the same E entries per block.
The tables come from the builders in `kernels.metadata`, selected through `kernels.backend`
("auto": Triton on CUDA, the torch references on CPU).

The reference model attends per request from a `SequenceState`, so what it consumes is each
request's cached prefix: the window rows before its first token (that token's window row minus
itself) and the entries [0, start // r) (the first start // r columns of its first token's
entry row). `dsv4.runner.reference.cache_state.load_states` gathers those through these tables; with
sharing off it rebuilds the tables for every layer (the pre-#45863 baseline).
The C4 layers' own per-layer metadata (their top-k as global slots, `c4_topk_slots`) is not
needed by the reference attention, which reads entries by local index; it is built here for
a sparse kernel and tested against the reference.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from dsv4.cache.layout import KVLayout
from dsv4.cache.packing import CacheRegion
from dsv4.ops.kv_codec import decode_rows
from dsv4.scheduler.batch import ScheduledRequest
from kernels import metadata as _builders  # importing registers the builders
from kernels.backend import KernelBackendConfig, resolve

DEFAULT_KERNELS = KernelBackendConfig()


@dataclass(frozen=True)
class SlotTableOptions:
    """The metadata speed switches; off selects each PR's baseline kernel (GPU backend only:
    on the reference backend there is one implementation)."""

    cached_token_to_req: bool = True  # once per step, not per builder (#47474)
    skip_redundant_fill: bool = True  # no torch.full(-1) pre-fill of the tables (#50298)


DEFAULT_SLOT_TABLE_OPTIONS = SlotTableOptions()


@dataclass(frozen=True)
class SlotTables:
    """Tables of one step (all int32 on the cache device; see the module docstring)."""

    starts: tuple[int, ...]  # host: first position of each request
    first_tokens: tuple[int, ...]  # host: row of each request's first token in the tables
    query_start_loc: torch.Tensor  # [B + 1]
    positions: torch.Tensor  # [T]
    token_to_req: torch.Tensor  # [T]
    block_tables: torch.Tensor  # [B, nb] token block ids, 0 padded
    ring_tables: torch.Tensor  # [B, num_ring_blocks] ring block ids
    window_slots: torch.Tensor  # [T, W] ring slots, -1 padded
    window_lens: torch.Tensor  # [T]
    entry_slots: Mapping[int, torch.Tensor]  # ratio -> [T, N_r] token-block slots, -1 padded
    entry_lens: Mapping[int, torch.Tensor]  # ratio -> [T]

    @property
    def num_requests(self) -> int:
        return len(self.starts)

    def prefix_window_slots(self, b: int, window: int) -> torch.Tensor:
        """Ring slots [n] of request b's cached window rows (positions before its start)."""
        n = min(self.starts[b], window - 1)  # the row holds n cached rows, then the token itself
        return self.window_slots[self.first_tokens[b], :n]

    def prefix_entry_slots(self, b: int, ratio: int) -> torch.Tensor:
        """Token-block slots [start // ratio] of request b's cached compressed entries."""
        return self.entry_slots[ratio][self.first_tokens[b], : self.starts[b] // ratio]


def build_slot_tables(
    layout: KVLayout,
    requests: Sequence[ScheduledRequest],
    device: torch.device | str,
    kernels: KernelBackendConfig = DEFAULT_KERNELS,
    options: SlotTableOptions = DEFAULT_SLOT_TABLE_OPTIONS,
) -> SlotTables:
    """Once per step: token->request, window ring slots and per-ratio entry slot tables."""
    on_triton = kernels.backend_for("window_slot_table", device) == "triton"
    cfg = layout.model
    lens = [r.num_tokens for r in requests]
    starts = tuple(r.start_position for r in requests)
    ends = list(itertools.accumulate(lens))
    qsl = torch.tensor([0, *ends], dtype=torch.int32, device=device)
    num_tokens = sum(lens)
    t2r_fn = resolve("token_to_req_indices", kernels, device)
    if not options.cached_token_to_req:
        t2r_fn = _builders.token_to_req_indices_per_builder
    t2r = t2r_fn(qsl, num_tokens)  # [T]
    positions = torch.cat(
        [torch.arange(r.start_position, r.end_position, device=device) for r in requests]
    )  # [T]
    max_end = max((r.end_position for r in requests), default=1)
    nb = max([len(r.block_table) for r in requests] + [1])
    tables = torch.zeros(len(requests), nb, dtype=torch.int32, device=device)
    for b, r in enumerate(requests):
        if r.block_table:
            tables[b, : len(r.block_table)] = torch.tensor(r.block_table, dtype=torch.int32)
    rings = torch.tensor([list(r.ring_block_ids) for r in requests], dtype=torch.int64)
    ring_slots = layout.region(0, "window").ring_slots
    ring_table = torch.zeros(  # every logical ring block -> page 0: slot = p % ring_slots
        len(requests), math.ceil(max_end / ring_slots), dtype=torch.int32, device=device
    )
    w = cfg.sliding_window
    window = resolve("window_slot_table", kernels, device)
    index_table = resolve("c128_index_table", kernels, device)
    if on_triton and not options.skip_redundant_fill:
        window = _builders.window_slot_table_prefill
        index_table = _builders.c128_index_table_prefill
    win_slots, win_lens = window(positions, t2r, ring_table, w, ring_slots)
    entry_slots, entry_lens = {}, {}
    for ratio in sorted({cfg.layer_ratio(i) for i in layout.layer_ids} - {0}):
        width = max(max_end // ratio, 1)
        epb = layout.block_size // ratio
        entry_slots[ratio], entry_lens[ratio] = index_table(
            positions, t2r, tables, width, epb, ratio
        )
    return SlotTables(
        starts, tuple([0, *ends][:-1]), qsl, positions, t2r, tables, rings.to(device),
        win_slots, win_lens, entry_slots, entry_lens,
    )  # fmt: skip


def c4_topk_slots(
    meta: SlotTables,
    local_idx: torch.Tensor,
    layout: KVLayout,
    kernels: KernelBackendConfig = DEFAULT_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A C4 layer's own metadata: its top-k local indices [T, k] (-1 padded) -> global
    token-block slots [T, k] and valid counts [T] (#51967)."""
    translate = resolve("c4_global_topk_slots", kernels, local_idx.device)
    return translate(local_idx.int().contiguous(), meta.token_to_req, meta.block_tables,
                     layout.block_size // 4)  # fmt: skip


# ---- gathers: slots -> rows of one layer's region ----------------------------------------------
def _decode(cache, region: CacheRegion, byte_starts: torch.Tensor) -> torch.Tensor:
    """[n] first-byte offsets of records -> [n, dim] fp32 rows."""
    model = cache.layout.model
    idx = byte_starts.unsqueeze(-1) + torch.arange(region.entry_bytes, device=cache.device)
    is_kv = region.kind in ("window", "compressed")
    dim = model.head_dim if is_kv else model.index_head_dim
    rope = model.qk_rope_head_dim if is_kv else 0
    return decode_rows(cache.backing.view(-1)[idx], region.dtype_name, dim, rope)


def gather_entries(cache, region: CacheRegion, slots: torch.Tensor) -> torch.Tensor:
    """Token-region rows at token-block slots [n] (slot = block * E + row) -> [n, dim]."""
    epb = region.entries_per_block
    slots = slots.long()
    block, row = slots // epb, slots % epb
    stride = cache.layout.block_stride_bytes
    return _decode(cache, region, block * stride + region.offset_bytes + row * region.entry_bytes)


def gather_ring(
    cache, region: CacheRegion, ring_ids: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Ring-region rows at ring slots [n] of one request (ring_ids [num_ring_blocks])."""
    assert region.ring_block_index is not None
    epb = region.entries_per_block
    slots = slots.long()
    block = ring_ids[region.ring_block_index + slots // epb]
    stride = cache.layout.block_stride_bytes
    row_bytes = (slots % epb) * region.entry_bytes
    return _decode(cache, region, block * stride + region.offset_bytes + row_bytes)
