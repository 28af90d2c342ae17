"""Entry formats and slab packing for the KV cache layout (see `dsv4.cache.layout`).

Pure functions used by `KVLayout.build`: bytes per entry of each cache kind
(docs/model.md#entry-formats), the dense packing of token-block regions, and the
first-fit-decreasing packing of the per-request ring regions into ring blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from dsv4.config.index_pattern import IndexPattern
from dsv4.config.model import ModelConfig
from dsv4.errors import ConfigError

ALIGN_BYTES = 16

KV_DTYPES = ("fp8", "bf16", "fp32")  # bf16/fp32: debug and exactness tests
INDEX_DTYPES = ("mxfp4", "fp8", "bf16", "fp32")

# Region kinds. Token kinds live in token blocks, ring kinds in ring blocks.
WINDOW = "window"
COMPRESSED = "compressed"
INDEXER = "indexer"
COMPRESSOR_STATE = "compressor_state"
INDEXER_STATE = "indexer_state"
TOKEN_KINDS = (COMPRESSED, INDEXER)
RING_KINDS = (WINDOW, COMPRESSOR_STATE, INDEXER_STATE)


@dataclass(frozen=True)
class CacheOptions:
    """Cache knobs that change the layout (all of them enter the compatibility hash)."""

    block_size: int = 256  # tokens per token block; multiple of 128 and of every ratio
    kv_dtype: str = "fp8"  # "fp8" | "bf16" | "fp32" (exact)
    index_dtype: str = "mxfp4"  # "mxfp4" | "fp8" | "bf16" | "fp32" (exact)
    num_speculative_tokens: int = 0  # extra ring slots for draft positions (MTP k)
    # IndexCache roles of the ratio-4 layers ("FSFS", see dsv4.model.index_cache); "" = all
    # Full. Shared layers never read their indexer keys: no indexer page, no indexer ring.
    index_pattern: str = ""


@dataclass(frozen=True)
class CacheRegion:
    """One layer's page of one cache kind inside a block's slab (addressing: `dsv4.cache.layout`)."""

    layer_id: int
    kind: str
    offset_bytes: int  # from the start of the block's slab
    page_bytes: int  # bytes inside one block (a split ring page's last block holds fewer)
    entries_per_block: int  # entries (token kinds) or ring slots (ring kinds) per block
    entry_bytes: int
    dtype_name: str  # "fp8_ue8m0" | "bf16" | "mxfp4" | "fp8_fp32scale" | "fp32"
    ring_block_index: int | None = None  # first ring block (ring kinds only)
    ring_slots: int = 0  # total ring slots (ring kinds only)

    @property
    def is_ring(self) -> bool:
        return self.ring_block_index is not None

    @property
    def num_ring_blocks(self) -> int:
        return math.ceil(self.ring_slots / self.entries_per_block) if self.is_ring else 0


# ---- entry formats -------------------------------------------------------------------------
def kv_entry_bytes(model: ModelConfig, kv_dtype: str) -> int:
    if kv_dtype in ("bf16", "fp32"):
        return model.head_dim * (2 if kv_dtype == "bf16" else 4)
    nope = model.nope_head_dim
    scale_bytes = round_up(math.ceil(nope / 64), 8)
    return nope + 2 * model.qk_rope_head_dim + scale_bytes


def index_entry_bytes(index_head_dim: int, index_dtype: str) -> int:
    if index_dtype == "mxfp4":
        return index_head_dim // 2 + index_head_dim // 32
    if index_dtype in ("bf16", "fp32"):
        return index_head_dim * (2 if index_dtype == "bf16" else 4)
    return index_head_dim + 4


def state_slot_bytes(overlap: int, dim: int) -> int:
    return 2 * overlap * dim * 4  # fp32 [a | z + ape], each c * d' wide


_KV_DTYPE_NAME = {"fp8": "fp8_ue8m0", "bf16": "bf16", "fp32": "fp32"}
_INDEX_DTYPE_NAME = {"mxfp4": "mxfp4", "fp8": "fp8_fp32scale", "bf16": "bf16", "fp32": "fp32"}


# ---- packing -------------------------------------------------------------------------------
def pack_token_regions(
    model: ModelConfig, options: CacheOptions, kv_entry: int, index_entry: int
) -> tuple[list[CacheRegion], int]:
    bs = options.block_size
    regions: list[CacheRegion] = []
    offset = 0
    ids = range(model.num_hidden_layers + (1 if model.has_mtp else 0))
    compressed = [(i, model.layer_ratio(i)) for i in ids if model.layer_ratio(i)]
    for layer_id, ratio in compressed:  # KV pages first: offsets stay multiples of kv_entry
        n = bs // ratio
        kv_name = _KV_DTYPE_NAME[options.kv_dtype]
        regions.append(
            CacheRegion(layer_id, COMPRESSED, offset, n * kv_entry, n, kv_entry, kv_name)
        )
        offset += n * kv_entry
    pattern = IndexPattern.from_string(model, options.index_pattern)
    for layer_id, ratio in compressed:
        if ratio != 4 or pattern.is_shared(layer_id):
            continue
        n = bs // 4
        offset = round_up(offset, ALIGN_BYTES)
        name = _INDEX_DTYPE_NAME[options.index_dtype]
        regions.append(
            CacheRegion(layer_id, INDEXER, offset, n * index_entry, n, index_entry, name)
        )
        offset += n * index_entry
    return regions, offset


class RingSpec(NamedTuple):
    """One per-request ring page before packing."""

    layer_id: int
    kind: str
    slots: int
    slot_bytes: int
    dtype_name: str

    @property
    def total_bytes(self) -> int:
        return self.slots * self.slot_bytes


def ring_specs(model: ModelConfig, options: CacheOptions, kv_entry: int) -> list[RingSpec]:
    """Every ring page in layer order: windows first, then compressor states."""
    k = options.num_speculative_tokens
    ids = range(model.num_hidden_layers + (1 if model.has_mtp else 0))
    kv_name = _KV_DTYPE_NAME[options.kv_dtype]
    pattern = IndexPattern.from_string(model, options.index_pattern)
    specs = [RingSpec(i, WINDOW, model.sliding_window + k, kv_entry, kv_name) for i in ids]
    for i in ids:
        ratio = model.layer_ratio(i)
        if not ratio:
            continue
        c = model.overlap(ratio)
        slots = c * ratio + k
        specs.append(
            RingSpec(i, COMPRESSOR_STATE, slots, state_slot_bytes(c, model.head_dim), "fp32")
        )
        if ratio == 4 and not pattern.is_shared(i):
            slot_bytes = state_slot_bytes(c, model.index_head_dim)
            specs.append(RingSpec(i, INDEXER_STATE, slots, slot_bytes, "fp32"))
    return specs


def pack_ring_regions(specs: list[RingSpec], stride: int) -> tuple[list[CacheRegion], int]:
    """First-fit decreasing of the ring pages into slabs of `stride` bytes.

    A page larger than a slab is split over whole consecutive ring blocks (offset 0 in each);
    the partly used tail block then only takes state pages. Inside a slab window pages come
    first, so their offsets stay multiples of the KV entry size.
    """
    bins: list[_RingBin] = []
    regions: list[CacheRegion] = []
    next_block = 0
    for layer_id, kind, slots, slot_bytes, dtype_name in specs:
        if slots * slot_bytes <= stride:
            continue  # split pages first: they need consecutive blocks
        per_block = stride // slot_bytes
        num_blocks = math.ceil(slots / per_block)
        regions.append(
            CacheRegion(layer_id, kind, 0, per_block * slot_bytes, per_block, slot_bytes,
                        dtype_name, ring_block_index=next_block, ring_slots=slots)
        )  # fmt: skip
        tail_bytes = (slots - per_block * (num_blocks - 1)) * slot_bytes
        next_block += num_blocks
        bins.append(_RingBin(next_block - 1, tail_bytes=tail_bytes))
    small = [spec for spec in specs if spec.total_bytes <= stride]
    for spec in sorted(small, key=lambda spec: -spec.total_bytes):  # stable: layer order
        target = next((b for b in bins if b.fits(spec, stride)), None)
        if target is None:
            target = _RingBin(next_block)
            next_block += 1
            bins.append(target)
        target.specs.append(spec)
    for ring_bin in bins:
        regions.extend(ring_bin.place())
    regions.sort(key=lambda r: (r.ring_block_index, r.offset_bytes))
    return regions, next_block


@dataclass
class _RingBin:
    """One ring block being filled: a split page's tail (states only after it), then pages."""

    block_index: int
    tail_bytes: int = 0
    specs: list[RingSpec] = field(default_factory=list)

    def fits(self, spec: RingSpec, stride: int) -> bool:
        if spec.kind == WINDOW and self.tail_bytes:
            return False
        candidate = _RingBin(self.block_index, self.tail_bytes, [*self.specs, spec])
        return candidate.used_bytes() <= stride

    def used_bytes(self) -> int:
        placed = self.place()
        return max([self.tail_bytes] + [r.offset_bytes + r.page_bytes for r in placed])

    def place(self) -> list[CacheRegion]:
        ordered = sorted(self.specs, key=lambda spec: spec.kind != WINDOW)  # windows first
        regions, offset = [], self.tail_bytes
        for layer_id, kind, slots, slot_bytes, dtype_name in ordered:
            if kind != WINDOW:
                offset = round_up(offset, ALIGN_BYTES)
            regions.append(
                CacheRegion(layer_id, kind, offset, slots * slot_bytes, slots, slot_bytes,
                            dtype_name, ring_block_index=self.block_index, ring_slots=slots)
            )  # fmt: skip
            offset += slots * slot_bytes
        return regions


def validate_options(model: ModelConfig, options: CacheOptions) -> None:
    bs = options.block_size
    ratios = {model.layer_ratio(i) for i in range(model.num_hidden_layers + 1)} - {0}
    if bs <= 0 or bs % 128 or any(bs % r for r in ratios):
        raise ConfigError("block_size", bs, "use a positive multiple of 128 (e.g. 256)")
    if options.kv_dtype not in KV_DTYPES:
        raise ConfigError("kv_dtype", options.kv_dtype, f"choose one of {KV_DTYPES}")
    if options.index_dtype not in INDEX_DTYPES:
        raise ConfigError("index_dtype", options.index_dtype, f"choose one of {INDEX_DTYPES}")
    if options.index_dtype == "mxfp4" and model.index_head_dim % 32:
        raise ConfigError("index_dtype", "mxfp4", "MXFP4 needs index_head_dim % 32 == 0")
    if options.num_speculative_tokens < 0:
        raise ConfigError("num_speculative_tokens", options.num_speculative_tokens, "use >= 0")
    IndexPattern.from_string(model, options.index_pattern)  # raises ConfigError when malformed


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
