"""The expert pool's slot kernels (references and the policy: `dsv4/ops/expert_slots.py`).

Both run without a host sync and read only device pointers, so a captured decode graph replays
them with whatever the routing chose (docs/architecture.md#expert-pool):
- `resolve_slots` (and `prefetch_slots`, its variant for a predicted routing): one program. The used experts are a histogram of the ids; the evictable
  cache slots are sorted by (evictable, age, index) keys in registers (`moe_align._sort`);
  the i-th miss (ascending id, an exclusive cumsum) takes the i-th slot of that order (a
  gather). Plain stores, a barrier, the scatters of the table / owner / fetch / age updates, a
  barrier, then each pair reads its row from the updated table. grid = 1: the barriers order
  this CTA's global writes and no other CTA writes these tensors.
- `copy_fetched`: grid (chunks,): program c copies chunk c of every part (w13, w2, their scales)
  of the host row fetch[j] into device row R + j, for each slot j with a fetch; a grid sized by
  the row, not by S x the row, so a step with few misses launches few idle programs.
  The host storage is pinned, so its address is a device address (UVA): the copy is plain
  loads over PCIe, inside the graph, with no cudaMemcpy for the host to issue.
- `copy_wait_start` / `copy_wait_end`: one program of one warp each, a read of the GPU's
  global nanosecond timer (`%globaltimer`) and a store into the layer's counters row. A kernel
  reads the timer when the stream starts it, i.e. once everything before it on the stream (and
  every stream it was made to wait for) is done, so the pair around a wait times the wait, in
  a captured graph too. The timer is inline PTX, which the CPU interpreter cannot run: on CPU
  tensors these two call their references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from dsv4.ops.expert_slots import (
    COPY_WAIT_MARK,
    COPY_WAIT_NS,
    COUNTERS,
    ERR_NO_HOST_ROW,
    ERR_OVERFLOW,
    ERR_STALE,
    ERRORS,
    MAX_AGE,
    MAX_SLOTS,
    PREFETCHES,
    STEP,
    SlotTable,
    copy_fetched_ref,
    copy_wait_end_ref,
    copy_wait_start_ref,
    prefetch_slots_ref,
    resolve_slots_ref,
)
from kernels.moe_align import _sort
from kernels.registry import register_op
from kernels.specialize import sizes_vary

_BLOCK_P = 64  # pairs per loop step
# bytes of a row part per program: an MXFP4 V4-Flash expert's w13 row (8 MiB) in 256 programs,
# enough loads in flight across the SMs to stream PCIe
_CHUNK = 1 << 15
_BLOCK_B = 4096  # bytes per load: 16-byte vectors, 4 warps
MAX_PARTS = 4


@triton.jit(**sizes_vary("P"))
def _resolve_kernel(
    ids_ptr, table_ptr, owner_ptr, last_ptr, cold_ptr, cnt_ptr, fetch_ptr, rows_ptr,
    P, E, S, R, row_bytes,
    BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
    MAX_AGE_C: tl.constexpr, STEP_C: tl.constexpr, ERRORS_C: tl.constexpr,
    OVERFLOW: tl.constexpr, STALE: tl.constexpr, NO_HOST: tl.constexpr,
    PREFETCH: tl.constexpr, PREFETCHES_C: tl.constexpr,
):  # fmt: skip
    e = tl.arange(0, BLOCK)
    e_ok = e < E
    used = tl.zeros([BLOCK], tl.int32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
        used += tl.histogram(tl.maximum(ids, 0), BLOCK, mask=ids >= 0)
    used = used > 0
    before = tl.load(table_ptr + e, mask=e_ok, other=-1)
    on_dev = before >= 0
    own = tl.load(owner_ptr + tl.maximum(before, 0), mask=e_ok & on_dev, other=-1)
    stale = tl.sum((used & on_dev & (own != e)).to(tl.int32), 0)
    miss = used & ~on_dev & e_ok
    cold = tl.load(cold_ptr + e, mask=e_ok, other=-1)
    no_host = tl.sum((miss & (cold < 0)).to(tl.int32), 0)

    j = e  # cache slot index (S <= BLOCK)
    j_ok = j < S
    slot_owner = tl.load(owner_ptr + R + j, mask=j_ok, other=-1)
    owner_used = (slot_owner >= 0) & (
        tl.gather(used.to(tl.int32), tl.maximum(slot_owner, 0), 0) > 0
    )
    evictable = j_ok & ~owner_used
    step = tl.load(cnt_ptr + STEP_C) + 1
    last = tl.load(last_ptr + j, mask=j_ok, other=0)
    age = tl.where(slot_owner < 0, MAX_AGE_C, tl.minimum(tl.maximum(step - last, 0), MAX_AGE_C))
    age = age.to(tl.int32)
    key = tl.where(evictable, 0, 1 << 29) | ((MAX_AGE_C - age) << 9) | j
    key = tl.where(j_ok, key, (1 << 30) - BLOCK + j)  # past-the-end lanes sort last
    by_rank = _sort(key, LOG_BLOCK) & 511  # slot of each rank
    n_miss = tl.sum(miss.to(tl.int32), 0)
    n_assign = tl.minimum(n_miss, tl.sum(evictable.to(tl.int32), 0))
    rank = tl.cumsum(miss.to(tl.int32), 0) - miss.to(tl.int32)
    assigned = miss & (rank < n_assign)
    slot = tl.gather(by_rank, tl.minimum(rank, BLOCK - 1), 0)  # [BLOCK] per expert
    slot = tl.where(assigned, slot, 0)  # past the evictable ones: a past-the-end lane's bits
    old = tl.gather(slot_owner, slot, 0)

    tl.store(fetch_ptr + j, tl.full([BLOCK], -1, tl.int32), mask=j_ok)
    tl.store(last_ptr + j, tl.where(owner_used, step, last), mask=j_ok)
    tl.debug_barrier()
    tl.store(fetch_ptr + slot, cold, mask=assigned)
    tl.store(last_ptr + slot, tl.zeros([BLOCK], tl.int64) + step, mask=assigned)
    tl.store(
        table_ptr + tl.maximum(old, 0), tl.full([BLOCK], -1, tl.int32), mask=assigned & (old >= 0)
    )
    tl.store(table_ptr + e, R + slot, mask=assigned)
    tl.store(owner_ptr + R + slot, e, mask=assigned)

    tl.store(cnt_ptr + 3, tl.load(cnt_ptr + 3) + n_assign.to(tl.int64) * row_bytes)
    errors = tl.where(stale > 0, STALE, 0) | tl.where(no_host > 0, NO_HOST, 0)
    if PREFETCH:  # a hint: no hits, no overflow, the step not advanced, no rows
        tl.store(cnt_ptr + PREFETCHES_C, tl.load(cnt_ptr + PREFETCHES_C) + n_assign.to(tl.int64))
        tl.store(cnt_ptr + ERRORS_C, tl.load(cnt_ptr + ERRORS_C) | errors.to(tl.int64))
    else:
        _count_and_write_rows(
            ids_ptr, table_ptr, cnt_ptr, rows_ptr, P, R, used, on_dev, before, n_miss, n_assign,
            errors, BLOCK_P, STEP_C, ERRORS_C, OVERFLOW, step,
        )  # fmt: skip


@triton.jit
def _count_and_write_rows(
    ids_ptr, table_ptr, cnt_ptr, rows_ptr, P, R, used, on_dev, before, n_miss, n_assign, errors,
    BLOCK_P: tl.constexpr, STEP_C: tl.constexpr, ERRORS_C: tl.constexpr, OVERFLOW: tl.constexpr,
    step,
):  # fmt: skip
    """`resolve_slots`' end: hits, fetches, the step and error bits counted, then each pair's
    row read from the updated table."""
    hit = used & on_dev
    tl.store(cnt_ptr + 0, tl.load(cnt_ptr + 0) + tl.sum((hit & (before < R)).to(tl.int64), 0))
    tl.store(cnt_ptr + 1, tl.load(cnt_ptr + 1) + tl.sum((hit & (before >= R)).to(tl.int64), 0))
    tl.store(cnt_ptr + 2, tl.load(cnt_ptr + 2) + n_assign.to(tl.int64))
    tl.store(cnt_ptr + STEP_C, step)
    errors = errors | tl.where(n_miss > n_assign, OVERFLOW, 0)
    tl.store(cnt_ptr + ERRORS_C, tl.load(cnt_ptr + ERRORS_C) | errors.to(tl.int64))
    tl.debug_barrier()
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
        row = tl.load(table_ptr + tl.maximum(ids, 0), mask=(p < P) & (ids >= 0), other=-1)
        row = tl.where(ids >= 0, tl.maximum(row, 0), -1)  # unplaced: row 0, flagged
        tl.store(rows_ptr + p, row, mask=p < P)


def resolve_slots(ids: torch.Tensor, slots: SlotTable) -> torch.Tensor:
    """`resolve_slots_ref` in one launch: ids [T, K] -> device rows [T, K] int32."""
    return _launch(ids, slots, prefetch=False)


def prefetch_slots(ids: torch.Tensor, slots: SlotTable) -> None:
    """`prefetch_slots_ref` in one launch (the same program, `PREFETCH`: no rows written)."""
    _launch(ids, slots, prefetch=True)


def _launch(ids: torch.Tensor, slots: SlotTable, prefetch: bool) -> torch.Tensor:
    table, owner, last_used, cold_row, counters, fetch = slots.tensors
    num_experts, num_slots = table.numel(), fetch.numel()
    assert num_slots <= num_experts <= MAX_SLOTS and counters.numel() == COUNTERS
    assert table.dtype == owner.dtype == cold_row.dtype == fetch.dtype == torch.int32
    flat = ids.reshape(-1)
    rows = torch.empty(flat.shape, dtype=torch.int32, device=ids.device)
    block = max(16, triton.next_power_of_2(num_experts))
    _resolve_kernel[(1,)](
        flat, table, owner, last_used, cold_row, counters, fetch, rows,
        flat.numel(), num_experts, num_slots, slots.num_resident, slots.row_bytes,
        BLOCK=block, LOG_BLOCK=block.bit_length() - 1, BLOCK_P=_BLOCK_P, MAX_AGE_C=MAX_AGE,
        STEP_C=STEP, ERRORS_C=ERRORS, OVERFLOW=ERR_OVERFLOW, STALE=ERR_STALE,
        NO_HOST=ERR_NO_HOST_ROW, PREFETCH=prefetch, PREFETCHES_C=PREFETCHES, num_warps=4,
    )  # fmt: skip
    return rows.view(ids.shape)


@triton.jit
def _copy_part(dst_ptr, src_ptr, n, src_stride, row, slot, c,
               CHUNK: tl.constexpr, BLOCK_B: tl.constexpr):  # fmt: skip
    src = src_ptr + row.to(tl.int64) * src_stride  # host rows may be strided views of blobs
    dst = dst_ptr + slot.to(tl.int64) * n
    for b0 in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, n), BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        tl.store(dst + b, tl.load(src + b, mask=b < n), mask=b < n)


@triton.jit(**sizes_vary("S"))
def _copy_kernel(
    fetch_ptr, d0, s0, n0, t0, d1, s1, n1, t1, d2, s2, n2, t2, d3, s3, n3, t3, R, S,
    NUM_PARTS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    for j in range(0, S):  # few fetches a step: the other slots cost one cached load each
        row = tl.load(fetch_ptr + j)
        if row >= 0:
            _copy_part(d0, s0, n0, t0, row, R + j, c, CHUNK, BLOCK_B)
            if NUM_PARTS > 1:
                _copy_part(d1, s1, n1, t1, row, R + j, c, CHUNK, BLOCK_B)
            if NUM_PARTS > 2:
                _copy_part(d2, s2, n2, t2, row, R + j, c, CHUNK, BLOCK_B)
            if NUM_PARTS > 3:
                _copy_part(d3, s3, n3, t3, row, R + j, c, CHUNK, BLOCK_B)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as [rows, row_bytes] uint8 (a view): each row contiguous, rows at any
    stride (a pool's host rows may be views into the offload store's expert blobs)."""
    return t.view(torch.uint8).view(t.shape[0], -1)


def copy_fetched(
    fetch: torch.Tensor,
    dst: tuple[torch.Tensor, ...],
    src: tuple[torch.Tensor, ...],
    num_resident: int,
) -> None:
    """`copy_fetched_ref` in one launch; `src` may be pinned host tensors (read through their
    device addresses) or, under the interpreter, plain CPU ones."""
    assert 0 < len(dst) == len(src) <= MAX_PARTS
    parts = []
    for d, s in zip(dst, src):
        db, sb = _bytes(d), _bytes(s)
        assert db.shape[1] == sb.shape[1] and d.dtype == s.dtype, (d.shape, s.shape)
        assert db.is_contiguous() and sb.stride(1) == 1
        parts.append((db, sb, db.shape[1], sb.stride(0)))
    num_parts = len(parts)
    parts += [parts[0]] * (MAX_PARTS - num_parts)
    chunks = triton.cdiv(max(n for _, _, n, _ in parts), _CHUNK)
    flat = [a for part in parts for a in part]
    _copy_kernel[(chunks,)](fetch, *flat, num_resident, fetch.numel(), NUM_PARTS=num_parts,
                            CHUNK=_CHUNK, BLOCK_B=_BLOCK_B, num_warps=4)  # fmt: skip


@triton.jit
def _copy_wait_start_kernel(cnt_ptr, MARK: tl.constexpr):
    tl.store(cnt_ptr + MARK, globaltimer())


@triton.jit(**sizes_vary("S"))
def _copy_wait_end_kernel(
    cnt_ptr, fetch_ptr, S,
    MARK: tl.constexpr, WAIT: tl.constexpr, IF_FETCHED: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    now = globaltimer()  # first: the wait ended when this program started
    waited = now - tl.load(cnt_ptr + MARK)
    if IF_FETCHED:  # fetch [S] int32: only a step that copied a row waited for one
        j = tl.arange(0, BLOCK_S)
        copied = tl.max(tl.load(fetch_ptr + j, mask=j < S, other=-1), 0) >= 0
        waited = tl.where(copied, waited, 0)
    tl.store(cnt_ptr + WAIT, tl.load(cnt_ptr + WAIT) + waited)


def clock_launches(counters: torch.Tensor, fetch: torch.Tensor | None = None) -> tuple:
    """(kernel, args, keywords) of `copy_wait_start` and of `copy_wait_end`, one program of one
    warp each: counters [COUNTERS] int64 (the layer's row), fetch [S] int32 or None (then the
    end adds unconditionally and reads no fetch: the counters stand in for its pointer)."""
    assert counters.numel() == COUNTERS and counters.dtype == torch.int64
    slots = 0 if fetch is None else fetch.numel()
    assert slots <= MAX_SLOTS
    start = (_copy_wait_start_kernel, (counters,), dict(MARK=COPY_WAIT_MARK, num_warps=1))
    end = (_copy_wait_end_kernel, (counters, counters if fetch is None else fetch, slots),
           dict(MARK=COPY_WAIT_MARK, WAIT=COPY_WAIT_NS, IF_FETCHED=fetch is not None,
                BLOCK_S=max(16, triton.next_power_of_2(slots)), num_warps=1))  # fmt: skip
    return start, end


def copy_wait_start(counters: torch.Tensor) -> None:
    """`copy_wait_start_ref` on the GPU's timer: one tiny launch (the reference on CPU)."""
    if not counters.is_cuda:  # the interpreter has no GPU timer
        copy_wait_start_ref(counters)
        return
    kernel, args, keywords = clock_launches(counters)[0]
    kernel[(1,)](*args, **keywords)


def copy_wait_end(counters: torch.Tensor, fetch: torch.Tensor | None = None) -> None:
    """`copy_wait_end_ref` on the GPU's timer: one tiny launch (the reference on CPU)."""
    if not counters.is_cuda:  # the interpreter has no GPU timer
        copy_wait_end_ref(counters, fetch)
        return
    kernel, args, keywords = clock_launches(counters, fetch)[1]
    kernel[(1,)](*args, **keywords)


register_op("resolve_slots", resolve_slots, resolve_slots_ref, family="expert_slots")
register_op("prefetch_slots", prefetch_slots, prefetch_slots_ref, family="expert_slots")
register_op("copy_fetched", copy_fetched, copy_fetched_ref, family="expert_slots")
register_op("copy_wait_start", copy_wait_start, copy_wait_start_ref, family="expert_slots")
register_op("copy_wait_end", copy_wait_end, copy_wait_end_ref, family="expert_slots")
