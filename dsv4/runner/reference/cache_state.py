"""Load a request's model state from the paged cache before a step, store what changed after.

The reference model continues a sequence from a `SequenceState` (window rows, compressed
entries, the compressor's pending tokens and, for ratio 4, the previous window's first halves).
The paged cache is the source of truth between steps; this module is the exact mapping:

- window: ring rows of positions [P - (W - 1), P), W = sliding_window;
- compressed entries / indexer keys: entries [0, P // r) from the token blocks;
- compressor pending tokens: state-ring rows [r * (P // r), P) as [a | z + ape];
- ratio-4 overlap: the first halves (a[:d'], z[:d']) of ring rows of the last complete window.

After the step, only new window rows, new entries and the live ring rows are written back.

`load_states` is the step-level fast path: it gathers the window rows and the compressed
entries through the step's shared slot tables (`dsv4.runner.reference.slot_tables`) instead of building
addresses per request and layer; `load_state` stays the reference it must equal. Layers whose
layout has no indexer pages (IndexCache Shared layers) get no indexer state.

The MTP layer's window (layer id num_hidden_layers) has its own ring region; the speculative
decoder reads and writes it with `load_mtp_window` / `store_mtp_window` (verified positions
only), since which of its rows are valid is known only to its `DraftContext`.
"""

from __future__ import annotations

import torch

from dsv4.model.state import CompressorState, LayerState, SequenceState
from dsv4.runner.kv_cache import PagedKVCache
from dsv4.runner.reference.slot_tables import (
    DEFAULT_KERNELS,
    DEFAULT_SLOT_TABLE_OPTIONS,
    SlotTableOptions,
    SlotTables,
    build_slot_tables,
    gather_entries,
    gather_ring,
)
from dsv4.scheduler.batch import ScheduledRequest
from kernels.backend import KernelBackendConfig

_ENTRY_KIND = {
    "compressor": ("compressed", "compressor_state"),
    "indexer": ("indexer", "indexer_state"),
}


def load_state(cache: PagedKVCache, req: ScheduledRequest, dtype: torch.dtype) -> SequenceState:
    """The state a request had after its first `req.start_position` tokens."""
    cfg = cache.layout.model
    pos = req.start_position
    state = _empty_state(cache, pos)
    w = cfg.sliding_window
    for layer_id, layer in enumerate(state.layers):
        lo = max(0, pos - (w - 1))
        if pos > lo:
            rows = cache.read_ring(layer_id, "window", req.ring_block_ids, lo, pos)
            layer.window = rows.to(dtype)
        ratio = cfg.layer_ratio(layer_id)
        for name in ("compressor", "indexer"):
            comp = getattr(layer, name)
            if comp is not None:
                _load_compressor(cache, req, layer_id, ratio, name, comp, pos, dtype)
    return state


def load_states(
    cache: PagedKVCache,
    requests: tuple[ScheduledRequest, ...],
    dtype: torch.dtype,
    *,
    shared_metadata: bool = True,
    kernels: KernelBackendConfig = DEFAULT_KERNELS,
    options: SlotTableOptions = DEFAULT_SLOT_TABLE_OPTIONS,
) -> list[SequenceState]:
    """`load_state` of every request of a step, gathering window rows and compressed entries
    through the step's slot tables: built once for all layers (`shared_metadata`, #45863) or
    rebuilt for every layer (the baseline)."""
    layout, cfg = cache.layout, cache.layout.model
    shared = build_slot_tables(layout, requests, cache.device, kernels, options)
    states = [_empty_state(cache, r.start_position) for r in requests]
    for layer_id in range(cfg.num_hidden_layers):
        meta = (
            shared
            if shared_metadata
            else build_slot_tables(layout, requests, cache.device, kernels, options)
        )
        window = layout.region(layer_id, "window")
        ratio = cfg.layer_ratio(layer_id)
        for b, (req, state) in enumerate(zip(requests, states)):
            layer = state.layers[layer_id]
            slots = meta.prefix_window_slots(b, cfg.sliding_window)
            if slots.numel():
                layer.window = gather_ring(cache, window, meta.ring_tables[b], slots).to(dtype)
            for name in ("compressor", "indexer"):
                comp = getattr(layer, name)
                if comp is not None:
                    entries = _gather_prefix_entries(cache, meta, b, layer_id, ratio, name)
                    _load_compressor(
                        cache, req, layer_id, ratio, name, comp, req.start_position, dtype, entries
                    )
    return states


def _gather_prefix_entries(
    cache: PagedKVCache, meta: SlotTables, b: int, layer_id: int, ratio: int, name: str
) -> torch.Tensor:
    region = cache.layout.region(layer_id, _ENTRY_KIND[name][0])
    return gather_entries(cache, region, meta.prefix_entry_slots(b, ratio))


def _empty_state(cache: PagedKVCache, pos: int) -> SequenceState:
    state = SequenceState.new(cache.layout.model)
    state.num_tokens = pos
    state.mtp = None  # the MTP layer's window is handled by the speculative decoder
    for layer_id, layer in enumerate(state.layers):
        if layer.indexer is not None and not _has_indexer_keys(cache, layer_id):
            layer.indexer = None  # IndexCache Shared layer: it never runs its indexer
        # fresh rows are attended to as the cache stores them (chunk invariance)
        layer.stored_kv = cache.stored_rows(layer_id, "window")
        for name in ("compressor", "indexer"):
            comp = getattr(layer, name)
            if comp is not None:
                comp.stored = cache.stored_rows(layer_id, _ENTRY_KIND[name][0])
    return state


def _has_indexer_keys(cache: PagedKVCache, layer_id: int) -> bool:
    return any(r.kind == "indexer" for r in cache.layout.regions_of_layer(layer_id))


def _load_compressor(
    cache: PagedKVCache,
    req: ScheduledRequest,
    layer_id: int,
    ratio: int,
    name: str,
    comp: CompressorState,
    pos: int,
    dtype: torch.dtype,
    entries: torch.Tensor | None = None,
) -> None:
    """`entries` [pos // ratio, d']: the cached entries when already gathered (fast path)."""
    entry_kind, ring_kind = _ENTRY_KIND[name]
    num_entries = pos // ratio
    if num_entries:
        if entries is None:
            entries = cache.read_entries(layer_id, entry_kind, req.block_table, 0, num_entries)
        comp.entries = entries.to(dtype)
    width = cache.layout.region(layer_id, ring_kind).entry_bytes // 8  # c * d' floats per half
    if pos > num_entries * ratio:
        rows = cache.read_ring(layer_id, ring_kind, req.ring_block_ids, num_entries * ratio, pos)
        comp.pending_kv, comp.pending_gate = rows[:, :width], rows[:, width:]
    if ratio == 4 and num_entries:
        dim = width // 2
        start = (num_entries - 1) * ratio
        rows = cache.read_ring(layer_id, ring_kind, req.ring_block_ids, start, start + ratio)
        comp.overlap_kv, comp.overlap_gate = rows[:, :dim], rows[:, width : width + dim]


def store_state(
    cache: PagedKVCache, req: ScheduledRequest, state: SequenceState, start: int, end: int
) -> None:
    """Write back what positions [start, end) changed in `state` (as left by the forward)."""
    cfg = cache.layout.model
    for layer_id, layer in enumerate(state.layers):
        if layer.window is not None:
            num_new = min(layer.window.shape[0], end - start)
            if num_new:
                rows = layer.window[-num_new:]
                cache.write_ring(layer_id, "window", req.ring_block_ids, end - num_new, rows)
        ratio = cfg.layer_ratio(layer_id)
        for name in ("compressor", "indexer"):
            comp = getattr(layer, name)
            if comp is not None:
                _store_compressor(cache, req, layer_id, ratio, name, comp, start, end)


def _store_compressor(
    cache: PagedKVCache,
    req: ScheduledRequest,
    layer_id: int,
    ratio: int,
    name: str,
    comp: CompressorState,
    start: int,
    end: int,
) -> None:
    entry_kind, ring_kind = _ENTRY_KIND[name]
    old, new = start // ratio, end // ratio
    if new > old:
        assert comp.entries is not None and comp.entries.shape[0] == new
        cache.write_entries(layer_id, entry_kind, req.block_table, old, comp.entries[old:new])
    width = cache.layout.region(layer_id, ring_kind).entry_bytes // 8
    if ratio == 4 and new > old:
        # The last complete window: only its first halves are read again (next entry's overlap).
        dim = width // 2
        rows = comp.overlap_kv.new_zeros(ratio, 2 * width)
        rows[:, :dim], rows[:, width : width + dim] = comp.overlap_kv, comp.overlap_gate
        cache.write_ring(layer_id, ring_kind, req.ring_block_ids, (new - 1) * ratio, rows)
    if comp.pending_kv is not None and comp.pending_kv.shape[0]:
        rows = torch.cat((comp.pending_kv, comp.pending_gate), dim=1)
        cache.write_ring(layer_id, ring_kind, req.ring_block_ids, new * ratio, rows)


# ---- the MTP layer's window (layer id = num_hidden_layers) ---------------------------------
def load_mtp_window(
    cache: PagedKVCache, ring_block_ids: tuple[int, ...], start: int, end: int, dtype: torch.dtype
) -> LayerState:
    """The MTP layer's window state before MTP position `end`: ring rows [start, end) (the
    caller passes start >= end - (W - 1) and only rows it knows were written)."""
    mtp_layer = cache.layout.model.num_hidden_layers
    layer = LayerState(stored_kv=cache.stored_rows(mtp_layer, "window"))
    if end > start:
        rows = cache.read_ring(mtp_layer, "window", ring_block_ids, start, end)
        layer.window = rows.to(dtype)
    return layer


def store_mtp_window(
    cache: PagedKVCache, ring_block_ids: tuple[int, ...], layer: LayerState, end: int, count: int
) -> int:
    """Write the MTP window rows of positions [end - n, end), n = min(count, rows held);
    returns n. Draft positions are never stored: only positions the target verified."""
    if layer.window is None:
        return 0
    num_rows = min(count, layer.window.shape[0])
    if num_rows:
        mtp_layer = cache.layout.model.num_hidden_layers
        rows = layer.window[-num_rows:]
        cache.write_ring(mtp_layer, "window", ring_block_ids, end - num_rows, rows)
    return num_rows
