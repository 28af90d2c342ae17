"""Per-step attention metadata, built once per step and shared by all layers
(docs/model.md#per-step-metadata).

- `token_to_req_indices` (#47474): request index of every token, on the device, from the
  query start locations, once per step; the slow path it replaces built it on the CPU in every
  metadata builder and copied it to the GPU each time (`token_to_req_indices_per_builder`).
- `window_slot_table`: [T, window] global SWA cache slots of positions max(0, p-window+1)..p
  through the block table, valid entries first then -1, plus the row lengths. The kernel writes
  every entry including the -1 tail, so no `torch.full(-1)` pre-fill is needed (#50298;
  `window_slot_table_prefill` is that slow path). Rows are split over several programs.
- `c128_index_table`: [T, width] "all visible compressed entries" of a ratio-r layer
  (i < (p+1)//r) as global compressed-cache slots; its rows can be ~8K wide in prefill, so each
  row is spread over many worker programs that stride over the row (#52084).
- `c4_global_topk_slots` (#51967): the indexer's local top-k (-1 padded) -> global compressed
  slots, slot = block_table[req][i // E]·E + i % E with E = entries per block; top-k width,
  E and the strides are compile-time constants. Padding tokens (request -1) get length 0.

Slot tables and lengths are int32; a request index of -1 marks a padding token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.registry import register_op
from kernels.specialize import sizes_vary


@triton.jit(**sizes_vary("T", "B"))
def _token_to_req_kernel(
    qsl_ptr,  # [B + 1] query start locations
    out_ptr,  # [T] int32
    T,
    B,
    BLOCK_T: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    count = tl.zeros([BLOCK_T], dtype=tl.int32)
    for b0 in range(0, B, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        ends = tl.load(qsl_ptr + 1 + b, mask=b < B, other=2147483647)
        count += tl.sum((ends[None, :] <= t[:, None]).to(tl.int32), axis=1)
    total = tl.load(qsl_ptr + B)
    tl.store(out_ptr + t, tl.where(t < total, count, -1), mask=t < T)


def token_to_req_indices(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """query_start_loc [B+1] int32 (device) -> [num_tokens] int32; tokens past the last request
    (CUDA-graph padding) get -1."""
    num_reqs = query_start_loc.numel() - 1
    out = torch.empty(num_tokens, dtype=torch.int32, device=query_start_loc.device)
    if num_tokens == 0:
        return out
    block_t = 128 if query_start_loc.is_cuda else min(1024, triton.next_power_of_2(num_tokens))
    block_b = min(
        128 if query_start_loc.is_cuda else 1024, triton.next_power_of_2(max(num_reqs, 1))
    )
    _token_to_req_kernel[(triton.cdiv(num_tokens, block_t),)](
        query_start_loc, out, num_tokens, num_reqs, BLOCK_T=block_t, BLOCK_B=block_b
    )
    return out


@triton.jit(**sizes_vary("T", "width", "stride_bt", "stride_out"))
def _range_slots_kernel(
    # Pointers: positions [T], token_to_req [T] int32, block_table [B, nb] int32;
    # outputs slots [T, width] int32, lens [T] int32
    pos_ptr, t2r_ptr, bt_ptr, out_ptr, lens_ptr,
    # Sizes, strides (elements), scalars
    T, width, stride_bt, stride_out, window, ratio,
    # Meta-parameters
    IS_WINDOW: tl.constexpr,  # window rows (base = max(0, p-window+1)) or all visible entries
    ENTRIES_PER_BLOCK: tl.constexpr,  # tokens (window) or compressed entries per cache block
    SLOTS_PER_BLOCK: tl.constexpr,  # slot = block * SLOTS_PER_BLOCK + i % ENTRIES_PER_BLOCK
    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
    WRITE_TAIL: tl.constexpr,  # write the -1 tail too (False = slow path after a pre-fill)
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    p = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int32)
    req = tl.load(t2r_ptr + rows, mask=row_ok, other=-1)
    if IS_WINDOW:
        base = tl.maximum(p - window + 1, 0)
        n = p - base + 1
    else:
        base = tl.zeros_like(p)
        n = (p + 1) // ratio
    n = tl.minimum(tl.where(req >= 0, n, 0), width)
    bt_row = bt_ptr + tl.maximum(req, 0).to(tl.int64) * stride_bt
    out_row = out_ptr + rows.to(tl.int64) * stride_out
    step = tl.num_programs(1) * BLOCK_W
    for w0 in range(tl.program_id(1) * BLOCK_W, width, step):  # workers stride over the row
        w = w0 + tl.arange(0, BLOCK_W)
        valid = w[None, :] < n[:, None]
        i = base[:, None] + w[None, :]
        blk = tl.load(bt_row[:, None] + i // ENTRIES_PER_BLOCK, mask=valid, other=0)
        slot = tl.where(valid, blk * SLOTS_PER_BLOCK + i % ENTRIES_PER_BLOCK, -1)
        if WRITE_TAIL:
            mask = row_ok[:, None] & (w < width)[None, :]
        else:
            mask = valid
        tl.store(out_row[:, None] + w[None, :], slot, mask=mask)
    if tl.program_id(1) == 0:
        tl.store(lens_ptr + rows, n, mask=row_ok)


def _range_slots(positions, token_to_req, block_table, width, entries_per_block, *,
                 is_window, window, ratio, write_tail, out=None, slots_per_block=None):  # fmt: skip
    num_tokens = positions.shape[0]
    dev = positions.device
    assert token_to_req.shape == (num_tokens,) and block_table.dim() == 2
    assert block_table.dtype == torch.int32 and block_table.stride(1) == 1
    slots = (
        out if out is not None else torch.empty(num_tokens, width, dtype=torch.int32, device=dev)
    )
    assert slots.shape == (num_tokens, width) and slots.stride(1) == 1
    lens = torch.empty(num_tokens, dtype=torch.int32, device=dev)
    if num_tokens == 0:
        return slots, lens
    on_gpu = positions.is_cuda
    block_w = min(triton.next_power_of_2(max(width, 1)), 128 if on_gpu else 1024)
    block_t = max(1, (1024 if on_gpu else 4096) // block_w)
    block_t = min(block_t, triton.next_power_of_2(num_tokens))
    t_blocks = triton.cdiv(num_tokens, block_t)
    w_chunks = triton.cdiv(width, block_w)
    # Several workers per row for long rows, but no more programs than ~8 waves of 132 SMs.
    workers = max(1, min(w_chunks, (1056 // t_blocks) if on_gpu else 2))
    _range_slots_kernel[(t_blocks, workers)](
        positions, token_to_req, block_table, slots, lens,
        num_tokens, width, block_table.stride(0), slots.stride(0), window, ratio,
        IS_WINDOW=is_window, ENTRIES_PER_BLOCK=entries_per_block,
        SLOTS_PER_BLOCK=slots_per_block or entries_per_block, BLOCK_T=block_t,
        BLOCK_W=block_w, WRITE_TAIL=write_tail, num_warps=4,
    )  # fmt: skip
    return slots, lens


def window_slot_table(positions, token_to_req, block_table, window, block_size, out=None,
                      slots_per_block=None):  # fmt: skip
    """positions [T] int32/int64, token_to_req [T] int32, block_table [B, nb] int32 (SWA cache)
    -> (slots [T, window] int32: slots of positions max(0, p-window+1)..p then -1, lens [T]).
    `out` ([T, window] int32) lets the caller reuse a workspace; no pre-fill is needed.
    slot = block * slots_per_block (default block_size) + i % block_size."""
    return _range_slots(positions, token_to_req, block_table, window, block_size,
                        is_window=True, window=window, ratio=1, write_tail=True, out=out,
                        slots_per_block=slots_per_block)  # fmt: skip


def window_slot_table_prefill(positions, token_to_req, block_table, window, block_size,
                              out=None, slots_per_block=None):  # fmt: skip
    """The pre-#50298 slow path: torch.full(-1) of the whole table, then write valid entries."""
    out = torch.full((positions.shape[0], window), -1, dtype=torch.int32, device=positions.device)
    return _range_slots(positions, token_to_req, block_table, window, block_size,
                        is_window=True, window=window, ratio=1, write_tail=False, out=out,
                        slots_per_block=slots_per_block)  # fmt: skip


def c128_index_table(positions, token_to_req, block_table, width, entries_per_block, ratio=128,
                     out=None, slots_per_block=None):  # fmt: skip
    """All visible compressed entries i < (p+1)//ratio of each token as global slots.

    block_table [B, nb] int32 of the compressed cache (entries_per_block = block_size // ratio)
    -> (slots [T, width] int32, -1 padded; lens [T] int32, clamped to width).
    slot = block * slots_per_block (default entries_per_block) + i % entries_per_block."""
    return _range_slots(positions, token_to_req, block_table, width, entries_per_block,
                        is_window=False, window=0, ratio=ratio, write_tail=True, out=out,
                        slots_per_block=slots_per_block)  # fmt: skip


def c128_index_table_prefill(positions, token_to_req, block_table, width, entries_per_block,
                             ratio=128, out=None, slots_per_block=None):  # fmt: skip
    """Slow path of `c128_index_table`: pre-fill with -1, then write the valid entries."""
    out = torch.full((positions.shape[0], width), -1, dtype=torch.int32, device=positions.device)
    return _range_slots(positions, token_to_req, block_table, width, entries_per_block,
                        is_window=False, window=0, ratio=ratio, write_tail=False, out=out,
                        slots_per_block=slots_per_block)  # fmt: skip


@triton.jit(**sizes_vary("T", "STRIDE_BT"))
def _c4_topk_slots_kernel(
    # Pointers: local_idx [T, TOPK] int32 (-1 pad), token_to_req [T], block_table [B, nb];
    # outputs slots [T, TOPK] int32, lens [T] int32
    idx_ptr, t2r_ptr, bt_ptr, out_ptr, lens_ptr,
    T,
    # Compile-time shape and strides (fixed per serving config, #51967)
    TOPK: tl.constexpr, ENTRIES_PER_BLOCK: tl.constexpr, STRIDE_IDX: tl.constexpr,
    STRIDE_BT, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    k = tl.arange(0, BLOCK_K)
    row_ok = rows < T
    in_row = row_ok[:, None] & (k < TOPK)[None, :]
    req = tl.load(t2r_ptr + rows, mask=row_ok, other=-1)
    i = tl.load(idx_ptr + rows.to(tl.int64)[:, None] * STRIDE_IDX + k[None, :], mask=in_row,
                other=-1)  # fmt: skip
    valid = in_row & (i >= 0) & (req >= 0)[:, None]
    bt_row = bt_ptr + tl.maximum(req, 0).to(tl.int64) * STRIDE_BT
    blk = tl.load(bt_row[:, None] + i // ENTRIES_PER_BLOCK, mask=valid, other=0)
    slot = tl.where(valid, blk * ENTRIES_PER_BLOCK + i % ENTRIES_PER_BLOCK, -1)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * TOPK + k[None, :], slot, mask=in_row)
    tl.store(lens_ptr + rows, tl.sum(valid.to(tl.int32), axis=1), mask=row_ok)


def c4_global_topk_slots(local_idx, token_to_req, block_table, entries_per_block):
    """local_idx [T, K] int32 (local compressed-entry indices, -1 padded), token_to_req [T],
    block_table [B, nb] int32 -> (slots [T, K] int32, lens [T] int32 = number of valid)."""
    num_tokens, topk = local_idx.shape
    assert local_idx.dtype == torch.int32 and local_idx.stride(1) == 1
    assert block_table.dtype == torch.int32 and block_table.stride(1) == 1
    slots = torch.empty(num_tokens, topk, dtype=torch.int32, device=local_idx.device)
    lens = torch.empty(num_tokens, dtype=torch.int32, device=local_idx.device)
    if num_tokens == 0:
        return slots, lens
    block_k = triton.next_power_of_2(topk)
    block_t = max(1, min((2048 if local_idx.is_cuda else 8192) // block_k,
                         triton.next_power_of_2(num_tokens)))  # fmt: skip
    _c4_topk_slots_kernel[(triton.cdiv(num_tokens, block_t),)](
        local_idx, token_to_req, block_table, slots, lens, num_tokens,
        TOPK=topk, ENTRIES_PER_BLOCK=entries_per_block, STRIDE_IDX=local_idx.stride(0),
        STRIDE_BT=block_table.stride(0), BLOCK_T=block_t, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return slots, lens


# --------------------------------------------------------------------------- references


def token_to_req_indices_ref(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    qsl = query_start_loc.long()
    reqs = torch.arange(qsl.numel() - 1, dtype=torch.int32, device=qsl.device)
    idx = torch.repeat_interleave(reqs, qsl.diff())[:num_tokens]
    pad = torch.full((num_tokens - idx.numel(),), -1, dtype=torch.int32, device=qsl.device)
    return torch.cat([idx, pad])


def token_to_req_indices_per_builder(query_start_loc, num_tokens, num_builders=3):
    """The pre-#47474 slow path: every metadata builder (SWA + one per compressor-state group)
    rebuilds the array on the CPU from host lengths and copies it to the device."""
    qsl_cpu = query_start_loc.cpu()  # the host copy each builder had
    out = None
    for _ in range(num_builders):
        host = token_to_req_indices_ref(qsl_cpu, num_tokens)
        if query_start_loc.is_cuda:
            host = host.pin_memory()
        out = host.to(query_start_loc.device, non_blocking=True)
    return out


def _range_slots_ref(base, n, req, block_table, entries_per_block, width, slots_per_block=None):
    w = torch.arange(width, device=base.device)
    valid = w[None, :] < n[:, None]
    i = torch.where(valid, base[:, None] + w[None, :], 0)
    blk = block_table.long()[req.clamp(min=0).long()[:, None], i // entries_per_block]
    spb = slots_per_block or entries_per_block
    slots = torch.where(valid, blk * spb + i % entries_per_block, -1)
    return slots.to(torch.int32), n.to(torch.int32)


def window_slot_table_ref(positions, token_to_req, block_table, window, block_size, out=None,
                          slots_per_block=None):  # fmt: skip
    p = positions.long()
    base = (p - window + 1).clamp(min=0)
    n = torch.where(token_to_req >= 0, p - base + 1, 0)
    return _range_slots_ref(base, n, token_to_req, block_table, block_size, window,
                            slots_per_block)  # fmt: skip


def c128_index_table_ref(positions, token_to_req, block_table, width, entries_per_block,
                         ratio=128, out=None, slots_per_block=None):  # fmt: skip
    p = positions.long()
    n = torch.where(token_to_req >= 0, (p + 1) // ratio, 0).clamp(max=width)
    return _range_slots_ref(torch.zeros_like(p), n, token_to_req, block_table,
                            entries_per_block, width, slots_per_block)  # fmt: skip


def c4_global_topk_slots_ref(local_idx, token_to_req, block_table, entries_per_block):
    i = local_idx.long()
    valid = (i >= 0) & (token_to_req >= 0)[:, None]
    i_c = torch.where(valid, i, 0)
    blk = block_table.long()[token_to_req.clamp(min=0).long()[:, None], i_c // entries_per_block]
    slots = torch.where(valid, blk * entries_per_block + i_c % entries_per_block, -1)
    return slots.to(torch.int32), valid.sum(dim=1).to(torch.int32)


register_op(
    "token_to_req_indices",
    token_to_req_indices,
    token_to_req_indices_ref,
    family="metadata",
    baseline_fn=token_to_req_indices_per_builder,
)
register_op(
    "window_slot_table",
    window_slot_table,
    window_slot_table_ref,
    family="metadata",
    baseline_fn=window_slot_table_prefill,
)
register_op(
    "c128_index_table",
    c128_index_table,
    c128_index_table_ref,
    family="metadata",
    baseline_fn=c128_index_table_prefill,
)
register_op(
    "c4_global_topk_slots", c4_global_topk_slots, c4_global_topk_slots_ref, family="metadata"
)
