"""Compressor state-ring slots -> float offsets of their rows, in one launch.

A compressor keeps each request's last c·r rows in a ring that may span several ring blocks
(docs/model.md#block-packing, geometry in `dsv4.runner.paged.geometry`):

    offset(req, s) = (ring_ids[req, rbi + s // epb] · block_stride + offset_bytes
                      + (s % epb) · entry_bytes) / 4          (-1 where s < 0)

Every compressor of a step needs this twice (the rows its programs read, the rows it saves):
about fifteen small torch kernels each time, the largest share of a decode step's glue launches
(5 compressors x 2 x 15 in the 4-layer V4-Flash shape). Integer math: the kernel and the torch
reference agree exactly. The paged forward now hands the slots to the compressor kernels
themselves (`PagedAddress`: the same formula in-kernel, no launch of its own); `ring_offsets`
stays the one-launch op for a caller that wants the offsets as a tensor.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.registry import register_op
from kernels.specialize import sizes_vary


@triton.jit
def ring_row(ring_ptr, req, s, num_reqs, stride_ring, rbi, epb, block_stride, offset_bytes,
             row_bytes):  # fmt: skip
    """Ring slot s (-1: none) of request `req` -> its row's float offset or -1 (the formula
    above; shared with the compressor kernels, which apply it to their `PagedAddress`)."""
    req = req.to(tl.int64)
    req = tl.where(req < 0, req + num_reqs, req)  # -1 (padding) indexes the last row, as in torch
    q = tl.maximum(s, 0).to(tl.int64)
    block = tl.load(ring_ptr + req * stride_ring + rbi + q // epb, mask=s >= 0, other=0)
    byte = block * block_stride + offset_bytes + (q % epb) * row_bytes
    return tl.where(s >= 0, byte // 4, -1)


@triton.jit(**sizes_vary("total", "num_reqs"))
def _ring_offsets_kernel(
    ring_ptr, req_ptr, slot_ptr, out_ptr,  # ring_ids [B, NR] int64, reqs [N], slots/out [N, C]
    total, C, num_reqs, stride_ring, rbi, epb, block_stride, offset_bytes, entry_bytes,
    BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < total
    s = tl.load(slot_ptr + i, mask=ok, other=-1)
    req = tl.load(req_ptr + i // C, mask=ok, other=0)
    row = ring_row(ring_ptr, req, s, num_reqs, stride_ring, rbi, epb, block_stride, offset_bytes,
                   entry_bytes)  # fmt: skip
    tl.store(out_ptr + i, row, mask=ok)


def ring_offsets(ring_ids: torch.Tensor, reqs: torch.Tensor, slots: torch.Tensor,
                 ring_block_index: int, entries_per_block: int, block_stride: int,
                 offset_bytes: int, entry_bytes: int) -> torch.Tensor:  # fmt: skip
    """ring_ids [B, NR] int64, reqs [N] int (one request per row of `slots`), slots [N] or
    [N, C] int64 ring slots (-1 = none) -> int64 offsets of the shape of `slots`."""
    assert ring_ids.dtype == torch.int64 and ring_ids.stride(1) == 1
    width = slots.shape[1] if slots.dim() == 2 else 1
    flat = slots.reshape(slots.shape[0], width).contiguous().long()  # [N, C]
    reqs = reqs.reshape(-1).contiguous()
    assert reqs.shape[0] == flat.shape[0], (reqs.shape, slots.shape)
    out = torch.empty_like(flat)
    total = flat.numel()
    if total:
        block = 256
        _ring_offsets_kernel[(triton.cdiv(total, block),)](
            ring_ids, reqs, flat, out, total, flat.shape[1], ring_ids.shape[0], ring_ids.stride(0),
            ring_block_index, entries_per_block, block_stride, offset_bytes, entry_bytes,
            BLOCK=block, num_warps=2,
        )  # fmt: skip
    return out.view(slots.shape)


def ring_offsets_ref(ring_ids: torch.Tensor, reqs: torch.Tensor, slots: torch.Tensor,
                     ring_block_index: int, entries_per_block: int, block_stride: int,
                     offset_bytes: int, entry_bytes: int) -> torch.Tensor:  # fmt: skip
    s = slots.clamp(min=0)
    rows = reqs.reshape(-1, *([1] * (slots.dim() - 1)))  # broadcast a row's request
    blocks = ring_ids[rows, ring_block_index + s // entries_per_block]
    byte = blocks * block_stride + offset_bytes + (s % entries_per_block) * entry_bytes
    return torch.where(slots >= 0, byte // 4, -1)


class PagedAddress(NamedTuple):
    """The paged cache's addressing of one compressor call (`kernels.compressor`), applied in
    the compressor kernels (no torch glue, no launch of its own) or, by their torch references
    and the CPU path, with `resolve`:
    - state ring slots s (-1 = none) -> the float offsets of the module doc, the request of a
      saved row from `token_reqs` [T], of a program's candidate rows from `reqs` [NB];
    - an entry in column `col` of its request's block table, row `entry_rows[b]` of that
      token block -> cache row block_tables[req, col] * entry_stride + entry_rows[b] *
      entry_unit + entry_base (KV slot or byte offset, `dsv4.runner.paged.geometry`)."""

    ring_ids: torch.Tensor  # [B, NR] int64 ring block ids of each request
    block_tables: torch.Tensor  # [B, nb] int token block ids of each request
    token_reqs: torch.Tensor  # [T] int: each token's request (-1 indexes the last, as torch)
    reqs: torch.Tensor  # [NB] int: each compress program's request
    entry_rows: torch.Tensor  # [NB] int64: each entry's row in its token block
    ring_block_index: int
    entries_per_block: int  # state rows per ring block
    block_stride: int  # bytes per cache block
    offset_bytes: int  # the state page's offset in its ring block
    entry_bytes: int  # bytes per state row
    entry_stride: int
    entry_unit: int
    entry_base: int

    def resolve(self, save_slots: torch.Tensor, window_slots: torch.Tensor,
                entry_cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """The torch formulas: save_slots [T], window_slots [NB, C] ring slots and entry_cols
        [NB] -> int64 (save rows, window rows, entry rows) as `compressor_step` takes them
        without a `PagedAddress`."""
        geom = (self.ring_block_index, self.entries_per_block, self.block_stride,
                self.offset_bytes, self.entry_bytes)  # fmt: skip
        reqs = self.reqs.long()
        save = ring_offsets_ref(self.ring_ids, self.token_reqs.long(), save_slots.long(), *geom)
        window = ring_offsets_ref(self.ring_ids, reqs, window_slots.long(), *geom)
        block = self.block_tables[reqs, entry_cols.long()].long()  # [NB] token blocks
        entry = torch.add(self.entry_rows.long() * self.entry_unit, block,
                          alpha=self.entry_stride) + self.entry_base  # fmt: skip
        return save, window, entry


register_op("ring_offsets", ring_offsets, ring_offsets_ref, family="ring_offsets")
