"""Compressor state-ring slots -> float offsets of their rows, in one launch.

A compressor keeps each request's last c·r rows in a ring that may span several ring blocks
(docs/model.md#block-packing, geometry in `dsv4.runner.paged.geometry`):

    offset(req, s) = (ring_ids[req, rbi + s // epb] · block_stride + offset_bytes
                      + (s % epb) · entry_bytes) / 4          (-1 where s < 0)

Every compressor of a step needs this twice (the rows its programs read, the rows it saves):
about fifteen small torch kernels each time, the largest share of a decode step's glue launches
(5 compressors x 2 x 15 in the 4-layer V4-Flash shape). Integer math: the kernel and the torch
reference agree exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.registry import register_op
from kernels.specialize import sizes_vary


@triton.jit(**sizes_vary("total", "num_reqs"))
def _ring_offsets_kernel(
    ring_ptr, req_ptr, slot_ptr, out_ptr,  # ring_ids [B, NR] int64, reqs [N], slots/out [N, C]
    total, C, num_reqs, stride_ring, rbi, epb, block_stride, offset_bytes, entry_bytes,
    BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < total
    s = tl.load(slot_ptr + i, mask=ok, other=-1)
    req = tl.load(req_ptr + i // C, mask=ok, other=0).to(tl.int64)
    req = tl.where(req < 0, req + num_reqs, req)  # -1 (padding) indexes the last row, as in torch
    q = tl.maximum(s, 0)
    block = tl.load(ring_ptr + req * stride_ring + rbi + q // epb, mask=ok, other=0)
    byte = block * block_stride + offset_bytes + (q % epb) * entry_bytes
    tl.store(out_ptr + i, tl.where(s >= 0, byte // 4, -1), mask=ok)


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


register_op("ring_offsets", ring_offsets, ring_offsets_ref, family="ring_offsets")
