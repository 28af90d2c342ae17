"""The packed paged KV cache layout: what lives where in ONE `[num_blocks, block_stride]` tensor.

Built once per worker from the model config and `CacheOptions`; the torch side (runner) makes
per-layer views from the `CacheRegion`s, the manager hands out block ids, and P and D compare
`compat_hash` before any KV pull. Pure Python (no torch).

Two kinds of block share the backing tensor (a block id is one kind at a time; the slab of a
block id is laid out for that kind only — the "overlay" of vLLM #48993):

- **token blocks** each cover `block_size` consecutive positions of one request and hold,
  per compressed layer, that span's compressed KV entries (block_size / r per layer) and, for
  ratio-4 layers, its indexer keys. Compressed entries never expire, so every token block of
  a request is live. A request's token blocks form its block table: entry i of a layer is row
  `i % entries_per_block` of block `block_table[i // entries_per_block]`.
- **ring blocks**: a fixed number (`num_ring_blocks`) per request, holding the state whose
  size does not grow with the sequence: per layer (MTP included) the raw sliding window as a
  ring of `sliding_window + num_speculative_tokens` slots (slot = position % slots), and per
  compressor the fp32 `[a | z + ape]` ring of `c * r + num_speculative_tokens` slots. The
  extra `num_speculative_tokens` slots keep rejected draft positions from overwriting
  window / state rows that the next step still reads. A ring region holds `entries_per_block`
  slots per ring block and spans `ceil(ring_slots / entries_per_block)` consecutive ring
  blocks starting at `ring_block_index` (only regions larger than a slab are split; they then
  start at offset 0 of each of their blocks; the last one holds the remaining slots). Slot s
  lives in the request's ring block number `ring_block_index + s // entries_per_block`, at
  byte `offset_bytes + (s % entries_per_block) * entry_bytes` of that block.

NOTE: the ring keeps only the last `slots` window positions, so a chunked-prefill step must
gather the prefix window from the ring before it writes the chunk's own tail into it.

So a P->D hand-off moves whole blocks and nothing dead: the ring blocks (window + partial
compressor state) and the token blocks (all compressed entries and indexer keys).

Inside a slab, regions are packed back to back (no holes except 16-byte alignment of non-KV
regions): KV pages (window or compressed, all `kv_entry_bytes` records) first, then indexer
pages / state pages. `block_stride` is a multiple of `kv_entry_bytes`, so every KV entry of
every layer also has a global slot id `(block * block_stride + offset) / kv_entry_bytes + row`
in one flat `[*, kv_entry_bytes]` view (what single-pool sparse attention kernels want).

Entry formats (docs/model.md#entry-formats), bytes per entry:
- KV "fp8": [nope e4m3 | rope bf16 | one UE8M0 byte per 64 nope dims, padded to 8] = 584 for
  head_dim 512; "bf16" / "fp32": head_dim * 2 / * 4 (exact: served = reference checks).
- indexer "mxfp4": d/2 packed e2m1 + d/32 UE8M0 scales (68 for d = 128); "fp8": d + 4 (132);
  "bf16" / "fp32" (exact): d * 2 / d * 4.
The formats are in `options`, hence in `compat_hash`: P and D of different formats never pair.
- compressor state: fp32, 2 * c * d' floats per slot (C4 main 8 KiB, C4 indexer 2 KiB,
  C128 4 KiB for Flash).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, replace

from dsv4.cache.packing import (
    ALIGN_BYTES,
    CacheOptions,
    CacheRegion,
    index_entry_bytes,
    kv_entry_bytes,
    pack_ring_regions,
    pack_token_regions,
    ring_specs,
    round_up,
    state_slot_bytes,
    validate_options,
)
from dsv4.config.index_pattern import IndexPattern
from dsv4.config.model import ModelConfig

LAYOUT_VERSION = 1
LAYER_KIND_BY_RATIO = {0: "swa", 4: "c4", 128: "c128"}


@dataclass(frozen=True)
class KindFootprint:
    """Memory of one layer kind ("swa" | "c4" | "c128"); sizes are per layer of that kind."""

    kind: str
    num_layers: int
    paged_bytes_per_token: float  # grows with the sequence: compressed KV + indexer keys
    ring_bytes_per_request: int  # fixed per request: window ring + compressor state rings
    raw_bf16_bytes_per_token: int  # what an uncompressed bf16 KV cache would store


@dataclass(frozen=True)
class KVLayout:
    """The cache layout of one worker. Build with `KVLayout.build(model, options)`."""

    model: ModelConfig
    options: CacheOptions
    regions: tuple[CacheRegion, ...]
    block_stride_bytes: int
    num_ring_blocks: int
    kv_entry_bytes: int
    index_entry_bytes: int
    version: int = LAYOUT_VERSION
    compat_hash: str = field(default="", compare=False)

    @classmethod
    def build(cls, model: ModelConfig, options: CacheOptions | None = None) -> KVLayout:
        """Called once at worker start-up (and by tests); raises `ConfigError` on bad options."""
        options = options or CacheOptions()
        validate_options(model, options)
        if IndexPattern.from_string(model, options.index_pattern).is_all_full:
            options = replace(options, index_pattern="")  # "FF" and "" are the same layout
        kv_entry = kv_entry_bytes(model, options.kv_dtype)
        index_entry = index_entry_bytes(model.index_head_dim, options.index_dtype)
        token_regions, token_slab = pack_token_regions(model, options, kv_entry, index_entry)
        specs = ring_specs(model, options, kv_entry)
        largest_entry = max([kv_entry, index_entry] + [spec.slot_bytes for spec in specs])
        quantum = math.lcm(ALIGN_BYTES, kv_entry)
        stride = round_up(max(token_slab, largest_entry), quantum)
        ring_regions, num_ring = pack_ring_regions(specs, stride)
        layout = cls(
            model=model,
            options=options,
            regions=tuple(token_regions + ring_regions),
            block_stride_bytes=stride,
            num_ring_blocks=num_ring,
            kv_entry_bytes=kv_entry,
            index_entry_bytes=index_entry,
        )
        object.__setattr__(layout, "compat_hash", _compat_hash(layout))
        return layout

    # ---- lookups ---------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.options.block_size

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """Main layers 0..L-1, then the MTP layer (id L) when the model has one."""
        n = self.model.num_hidden_layers
        return tuple(range(n + (1 if self.model.has_mtp else 0)))

    def region(self, layer_id: int, kind: str) -> CacheRegion:
        for region in self.regions:
            if region.layer_id == layer_id and region.kind == kind:
                return region
        raise KeyError(f"layer {layer_id} has no {kind!r} cache")

    def regions_of_layer(self, layer_id: int) -> tuple[CacheRegion, ...]:
        return tuple(r for r in self.regions if r.layer_id == layer_id)

    # ---- sizing ----------------------------------------------------------------------------
    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        """Blocks that fit in `budget_bytes` of device memory (the runner sizes the tensor)."""
        return max(0, budget_bytes // self.block_stride_bytes)

    def num_token_blocks(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def num_blocks_for_request(self, num_tokens: int) -> int:
        """Ring blocks + token blocks a request of `num_tokens` positions holds."""
        return self.num_ring_blocks + self.num_token_blocks(num_tokens)

    def compacted_bytes(self, num_tokens: int) -> int:
        """Bytes a P->D hand-off of a `num_tokens` request moves (whole blocks)."""
        return self.num_blocks_for_request(num_tokens) * self.block_stride_bytes

    def live_state_bytes(self, num_tokens: int) -> int:
        """The exact live payload (no block rounding): last window rows, every compressed entry
        and indexer key, the compressor rows a later entry still needs."""
        total = 0
        model, n = self.model, num_tokens
        pattern = IndexPattern.from_string(model, self.options.index_pattern)
        for layer_id in self.layer_ids:
            ratio = model.layer_ratio(layer_id)
            total += min(n, model.sliding_window) * self.kv_entry_bytes
            if not ratio:
                continue
            c = model.overlap(ratio)
            live_slots = min(n, (c - 1) * ratio + n % ratio)
            total += (n // ratio) * self.kv_entry_bytes
            total += live_slots * state_slot_bytes(c, model.head_dim)
            if ratio == 4 and not pattern.is_shared(layer_id):
                total += (n // 4) * self.index_entry_bytes
                total += live_slots * state_slot_bytes(c, model.index_head_dim)
        return total

    def raw_bf16_bytes(self, num_tokens: int) -> int:
        """An uncompressed bf16 cache of every layer's full KV (the comparison point)."""
        return len(self.layer_ids) * num_tokens * self.model.head_dim * 2

    def bytes_per_token(self) -> dict[str, KindFootprint]:
        """Per layer kind: paged bytes per token and fixed ring bytes (start-up log, capacity)."""
        out: dict[str, KindFootprint] = {}
        for layer_id in self.layer_ids:
            ratio = self.model.layer_ratio(layer_id)
            kind = LAYER_KIND_BY_RATIO[ratio]
            if kind in out:
                out[kind] = replace(out[kind], num_layers=out[kind].num_layers + 1)
                continue
            regions = self.regions_of_layer(layer_id)
            paged = sum(r.page_bytes for r in regions if not r.is_ring) / self.block_size
            ring = sum(r.ring_slots * r.entry_bytes for r in regions if r.is_ring)
            out[kind] = KindFootprint(kind, 1, paged, ring, self.model.head_dim * 2)
        return out

    def describe(self) -> dict[str, object]:
        """Everything that must match between P and D (the compat hash input)."""
        m = self.model
        return {
            "version": self.version,
            "options": asdict(self.options),
            "model": {
                "head_dim": m.head_dim,
                "qk_rope_head_dim": m.qk_rope_head_dim,
                "index_head_dim": m.index_head_dim,
                "sliding_window": m.sliding_window,
                "ratios": [m.layer_ratio(i) for i in self.layer_ids],
            },
            "block_stride_bytes": self.block_stride_bytes,
            "num_ring_blocks": self.num_ring_blocks,
            "regions": [asdict(r) for r in self.regions],
        }


def _compat_hash(layout: KVLayout) -> str:
    canonical = json.dumps(layout.describe(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
