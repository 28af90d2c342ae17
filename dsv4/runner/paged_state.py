"""Load a request's model state from the paged cache before a step, store what changed after.

The reference model continues a sequence from a `SequenceState` (window rows, compressed
entries, the compressor's pending tokens and, for ratio 4, the previous window's first halves).
The paged cache is the source of truth between steps; this module is the exact mapping:

- window: ring rows of positions [P - (W - 1), P), W = sliding_window;
- compressed entries / indexer keys: entries [0, P // r) from the token blocks;
- compressor pending tokens: state-ring rows [r * (P // r), P) as [a | z + ape];
- ratio-4 overlap: the first halves (a[:d'], z[:d']) of ring rows of the last complete window.

After the step, only new window rows, new entries and the live ring rows are written back.
"""

from __future__ import annotations

import torch

from dsv4.model.state import CompressorState, SequenceState
from dsv4.runner.paged_cache import PagedKVCache
from dsv4.scheduler.batch import ScheduledRequest

_ENTRY_KIND = {
    "compressor": ("compressed", "compressor_state"),
    "indexer": ("indexer", "indexer_state"),
}


def load_state(cache: PagedKVCache, req: ScheduledRequest, dtype: torch.dtype) -> SequenceState:
    """The state a request had after its first `req.start_position` tokens."""
    cfg = cache.layout.model
    pos = req.start_position
    state = SequenceState.new(cfg)
    state.num_tokens = pos
    state.mtp = None  # the MTP layer's window is handled by the speculative decoder
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


def _load_compressor(
    cache: PagedKVCache,
    req: ScheduledRequest,
    layer_id: int,
    ratio: int,
    name: str,
    comp: CompressorState,
    pos: int,
    dtype: torch.dtype,
) -> None:
    entry_kind, ring_kind = _ENTRY_KIND[name]
    num_entries = pos // ratio
    if num_entries:
        rows = cache.read_entries(layer_id, entry_kind, req.block_table, 0, num_entries)
        comp.entries = rows.to(dtype)
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
