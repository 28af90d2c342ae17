"""The torch side of the packed paged KV cache: ONE `[num_blocks, block_stride]` uint8 tensor.

`dsv4.cache.layout.KVLayout` says where every layer's pages sit inside a block's slab; this class
owns the backing tensor and reads/writes entries by (block table, entry index) for token regions
and by (ring blocks, position) for ring regions, encoding and decoding the byte formats of
`dsv4.ops.kv_codec`. Transports register `backing` once and move whole blocks.

This is the reference access path (gather/scatter of byte records); GPU kernels read the same
bytes directly.
"""

from __future__ import annotations

from functools import partial

import torch

from dsv4.cache.layout import KVLayout
from dsv4.cache.packing import CacheRegion
from dsv4.model.state import RoundTrip
from dsv4.ops.kv_codec import decode_rows, encode_rows, round_trip


class PagedKVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu",
                 num_scratch_blocks: int = 0):  # fmt: skip
        """`num_blocks` are handed out by the block manager; `num_scratch_blocks` more rows
        (ids num_blocks..) belong to no request: the padding rows of a captured decode step
        write there (`dsv4.runner.paged.graphs`)."""
        self.layout = layout
        self.num_blocks = num_blocks
        self.scratch_block_ids = tuple(range(num_blocks, num_blocks + num_scratch_blocks))
        # [num_blocks + scratch, block_stride] raw bytes; a block's pages are contiguous.
        self.backing = torch.zeros(
            num_blocks + num_scratch_blocks, layout.block_stride_bytes, dtype=torch.uint8,
            device=device,
        )  # fmt: skip
        self._flat = self.backing.view(-1)
        self._rope_dim = layout.model.qk_rope_head_dim

    @property
    def device(self) -> torch.device:
        return self.backing.device

    # ---- addressing ------------------------------------------------------------------------
    def _byte_index(
        self, region: CacheRegion, block_ids: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """[n] blocks, [n] rows within the region's page -> [n, entry_bytes] flat byte offsets."""
        base = block_ids * self.layout.block_stride_bytes + region.offset_bytes
        base = base + rows * region.entry_bytes
        return base.unsqueeze(-1) + torch.arange(region.entry_bytes, device=self.device)

    def _token_index(
        self, region: CacheRegion, block_table: list[int] | tuple[int, ...], entries: torch.Tensor
    ) -> torch.Tensor:
        epb = region.entries_per_block
        table = torch.as_tensor(block_table, dtype=torch.int64, device=self.device)
        return self._byte_index(region, table[entries // epb], entries % epb)

    def _ring_index(
        self,
        region: CacheRegion,
        ring_block_ids: list[int] | tuple[int, ...],
        positions: torch.Tensor,
    ) -> torch.Tensor:
        slots = positions % region.ring_slots
        epb = region.entries_per_block
        assert region.ring_block_index is not None
        ring = torch.as_tensor(ring_block_ids, dtype=torch.int64, device=self.device)
        return self._byte_index(region, ring[region.ring_block_index + slots // epb], slots % epb)

    def _dim(self, region: CacheRegion) -> int:
        """Float width of one entry of this region."""
        model = self.layout.model
        if region.kind in ("window", "compressed"):
            return model.head_dim
        if region.kind == "indexer":
            return model.index_head_dim
        return region.entry_bytes // 4  # fp32 compressor state rows

    def _rope(self, region: CacheRegion) -> int:
        return self._rope_dim if region.kind in ("window", "compressed") else 0

    def stored_rows(self, layer_id: int, kind: str) -> RoundTrip | None:
        """rows -> rows as this region gives them back; None where that is exact (fp32)."""
        region = self.layout.region(layer_id, kind)
        if region.dtype_name == "fp32":
            return None
        return partial(round_trip, dtype_name=region.dtype_name, entry_bytes=region.entry_bytes,
                       rope_dim=self._rope(region))  # fmt: skip

    # ---- token regions: compressed KV and indexer keys -------------------------------------
    def read_entries(
        self, layer_id: int, kind: str, block_table: tuple[int, ...], start: int, end: int
    ) -> torch.Tensor:
        """Entries [start, end) of a request -> [end - start, dim] fp32."""
        region = self.layout.region(layer_id, kind)
        entries = torch.arange(start, end, device=self.device)
        records = self._flat[self._token_index(region, block_table, entries)]
        return decode_rows(records, region.dtype_name, self._dim(region), self._rope(region))

    def write_entries(
        self, layer_id: int, kind: str, block_table: tuple[int, ...], start: int, rows: torch.Tensor
    ) -> None:
        """rows [n, dim] become entries [start, start + n) of the request."""
        if rows.shape[0] == 0:
            return
        region = self.layout.region(layer_id, kind)
        entries = torch.arange(start, start + rows.shape[0], device=self.device)
        records = encode_rows(rows, region.dtype_name, region.entry_bytes, self._rope(region))
        self._flat[self._token_index(region, block_table, entries)] = records.to(self.device)

    # ---- ring regions: window KV and compressor state -------------------------------------
    def read_ring(
        self, layer_id: int, kind: str, ring_block_ids: tuple[int, ...], start: int, end: int
    ) -> torch.Tensor:
        """Rows of positions [start, end) -> [end - start, dim] fp32 (must still be in the ring)."""
        region = self.layout.region(layer_id, kind)
        assert end - start <= region.ring_slots, "ring read wider than the ring"
        positions = torch.arange(start, end, device=self.device)
        records = self._flat[self._ring_index(region, ring_block_ids, positions)]
        return decode_rows(records, region.dtype_name, self._dim(region), self._rope(region))

    def write_ring(
        self,
        layer_id: int,
        kind: str,
        ring_block_ids: tuple[int, ...],
        start: int,
        rows: torch.Tensor,
    ) -> None:
        """rows [n, dim] are positions [start, start + n); only the last `ring_slots` are kept."""
        region = self.layout.region(layer_id, kind)
        num_rows = rows.shape[0]
        keep = min(num_rows, region.ring_slots)
        if keep == 0:
            return
        rows = rows[-keep:]
        first = start + num_rows - keep
        positions = torch.arange(first, first + keep, device=self.device)
        records = encode_rows(rows, region.dtype_name, region.entry_bytes, self._rope(region))
        self._flat[self._ring_index(region, ring_block_ids, positions)] = records.to(self.device)
