"""Where each layer's cache lives inside the one backing tensor, as kernel-ready views.

The paged forward (`dsv4.runner.paged`) reads and writes the packed cache in place: the sparse
attention kernel reads KV rows by *global slot* of one flat `[num_slots, kv_entry_bytes]` view
(the layout keeps every KV page at a multiple of the entry size, `dsv4.cache.layout`), the
indexer reads its keys through a paged `[num_blocks, E, row]` view, and the compressor kernel
writes entries and reads/writes its fp32 state ring rows by element offset.

Addressing (all in ints the kernels take):
- compressed entry i of a request (layer L, ratio r, E = block_size / r entries per block):
  slot = block_table[i // E] * SPB + comp_base_L + i % E, SPB = block_stride / kv_entry_bytes;
  tables shared by every layer of a kind hold `block * SPB + i % E`, and each layer adds its
  `comp_base` (the page offset in entries) at the kernel;
- window ring slot s = p % R of a request: slot = win_block * SPB + win_base_L + s, with
  win_block = ring_ids[ring_block_index_L] (the ring page must fit one block: checked);
- compressor state ring slot s: float offset (ring_ids[rbi + s // epb] * block_stride + offset
  + (s % epb) * entry_bytes) / 4 (state rings may span several ring blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dsv4.cache.layout import KVLayout
from dsv4.errors import ConfigError

KEY_FORMAT = {"mxfp4": "mxfp4", "fp8_fp32scale": "fp8_fp32scale", "bf16": "plain", "fp32": "plain"}
_FLOAT = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class RingPage:
    """A per-request ring region (window or compressor state) of one layer."""

    ring_block_index: int
    offset_bytes: int
    entries_per_block: int
    entry_bytes: int
    slots: int


@dataclass(frozen=True)
class CompressorGeometry:
    """One compressor (a layer's main KV compressor or its indexer's key compressor)."""

    ratio: int
    dim: int  # d' of the entries (head_dim or index_head_dim)
    entry_format: str  # kernels.compressor format of the entries
    is_kv: bool  # main compressor: entries are KV slots; indexer: byte-addressed key records
    # Entry i of a request lands at block_table[i // E] * entry_stride + entry_base
    # + (i % E) * entry_unit: KV slots (unit 1, stride SPB) or bytes (unit/stride in bytes).
    entry_base: int
    entry_stride: int
    entry_unit: int
    entry_bytes: int
    entries_per_block: int
    state: RingPage


@dataclass(frozen=True)
class LayerGeometry:
    layer_id: int
    ratio: int
    window: RingPage
    window_base: int  # KV slot offset of the window page inside its ring block
    comp_base: int  # KV slot offset of the compressed page (0 for SWA layers)
    compressor: CompressorGeometry | None
    indexer: CompressorGeometry | None  # None for non-C4 and IndexCache Shared layers
    indexer_key_format: str = ""


class CacheGeometry:
    """Kernel views of one `PagedKVCache` backing tensor, built once per runner."""

    def __init__(self, layout: KVLayout, backing: torch.Tensor) -> None:
        self.layout = layout
        self.backing = backing  # [num_blocks, block_stride] uint8
        self.stride = layout.block_stride_bytes
        self.kve = layout.kv_entry_bytes
        assert self.stride % self.kve == 0
        self.slots_per_block = self.stride // self.kve  # SPB
        flat = backing.view(-1)
        self.num_kv_slots = flat.numel() // self.kve
        self.kv_bytes = flat[: self.num_kv_slots * self.kve].view(self.num_kv_slots, self.kve)
        kv_dtype = layout.options.kv_dtype
        self.kv_format = "fp8_ue8m0" if kv_dtype == "fp8" else kv_dtype
        if kv_dtype in _FLOAT:  # typed rows for the attention kernel's plain path
            self.kv_rows = self.kv_bytes.view(_FLOAT[kv_dtype]).view(self.num_kv_slots, -1)
        else:
            self.kv_rows = self.kv_bytes  # uint8 fp8_ue8m0 records
        self.flat_bytes = flat
        self.flat_f32 = flat.view(torch.float32)
        # Indexed by layer id; the MTP layer (id num_hidden_layers) is last when the model has it.
        self.layers = tuple(self._layer(i) for i in layout.layer_ids)
        self._window_pages: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def window_pages(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """([L] ring block index, [L] KV slot offset) of every layer's window page, on
        `device`, built once (not a host->device copy per step)."""
        if device not in self._window_pages:
            rbi = [g.window.ring_block_index for g in self.layers]
            base = [g.window_base for g in self.layers]
            self._window_pages[device] = (torch.tensor(rbi, device=device),
                                          torch.tensor(base, device=device))  # fmt: skip
        return self._window_pages[device]

    def window_pages_host(self) -> tuple[np.ndarray, np.ndarray]:
        """`window_pages` as host int64 arrays [L] each (an eager step's upload builds every
        request's window bases from them with numpy)."""
        rbi = np.asarray([g.window.ring_block_index for g in self.layers], dtype=np.int64)
        return rbi, np.asarray([g.window_base for g in self.layers], dtype=np.int64)

    # ---- per layer ---------------------------------------------------------------------------
    def _ring(self, layer_id: int, kind: str) -> RingPage:
        r = self.layout.region(layer_id, kind)
        assert r.ring_block_index is not None
        return RingPage(r.ring_block_index, r.offset_bytes, r.entries_per_block, r.entry_bytes,
                        r.ring_slots)  # fmt: skip

    def _layer(self, layer_id: int) -> LayerGeometry:
        cfg = self.layout.model
        ratio = cfg.layer_ratio(layer_id)
        win = self._ring(layer_id, "window")
        if win.slots > win.entries_per_block:
            raise ConfigError(
                "block_size", self.layout.block_size,
                "the paged forward needs each window ring in one block: use a larger block_size",
            )  # fmt: skip
        assert win.offset_bytes % self.kve == 0
        comp = idx = None
        comp_base, key_format = 0, ""
        if ratio:
            page = self.layout.region(layer_id, "compressed")
            assert page.offset_bytes % self.kve == 0
            comp_base = page.offset_bytes // self.kve
            comp = CompressorGeometry(
                ratio, cfg.head_dim, self.kv_format, True, comp_base, self.slots_per_block, 1,
                page.entry_bytes, page.entries_per_block, self._ring(layer_id, "compressor_state"),
            )  # fmt: skip
            if any(r.kind == "indexer" for r in self.layout.regions_of_layer(layer_id)):
                keys = self.layout.region(layer_id, "indexer")
                idx = CompressorGeometry(
                    4, cfg.index_head_dim, keys.dtype_name, False, keys.offset_bytes, self.stride,
                    keys.entry_bytes, keys.entry_bytes, keys.entries_per_block, self._ring(layer_id, "indexer_state"),
                )  # fmt: skip
                key_format = KEY_FORMAT[keys.dtype_name]
        return LayerGeometry(layer_id, ratio, win, win.offset_bytes // self.kve, comp_base, comp,
                             idx, key_format)  # fmt: skip

    # ---- views -------------------------------------------------------------------------------
    def indexer_keys(self, layer: LayerGeometry) -> torch.Tensor:
        """The layer's indexer keys as a paged view [num_blocks, E, row] (uint8 records, or
        typed [num_blocks, E, d] rows for the debug formats)."""
        g = layer.indexer
        assert g is not None
        nb = self.backing.shape[0]
        if layer.indexer_key_format != "plain":
            shape, strides = (
                (nb, g.entries_per_block, g.entry_bytes),
                (self.stride, g.entry_bytes, 1),
            )
            return torch.as_strided(self.flat_bytes, shape, strides, g.entry_base)
        dtype = _FLOAT[g.entry_format]
        size = torch.tensor([], dtype=dtype).element_size()
        typed = self.flat_bytes.view(dtype)
        shape = (nb, g.entries_per_block, g.dim)
        strides = (self.stride // size, g.entry_bytes // size, 1)
        return torch.as_strided(typed, shape, strides, g.entry_base // size)

    def entry_rows(self, g: CompressorGeometry) -> torch.Tensor:
        """Destination rows of a compressor's entries for `kernels.compressor`: the KV slot view
        (main), or a byte-addressed view of the indexer pages (row = byte offset)."""
        if g.is_kv:
            return self.kv_bytes
        n = self.flat_bytes.numel() - g.entry_bytes + 1
        return torch.as_strided(self.flat_bytes, (n, g.entry_bytes), (1, 1))

    def state_rows(self, g: CompressorGeometry) -> torch.Tensor:
        """fp32 state rows [*, 2*c*d'] addressed by float offset (row stride 1)."""
        width = g.state.entry_bytes // 4
        n = self.flat_f32.numel() - width + 1
        return torch.as_strided(self.flat_f32, (n, width), (1, 1))
