"""KV cache rows in and out of the packed byte records (docs/model.md#entry-formats, `kv_codec`).

`kv_store` writes rows [T, D] (bf16 or fp32) into the rows `slots` of a byte cache
[num_slots, entry_bytes] exactly as `kv_codec.encode_rows` does; `kv_gather` reads the records
at `slots` back as `decode_rows` does. Formats (D = head dim, R = rope dims, nope = D - R):
- "fp8_ue8m0": [nope e4m3 | rope bf16 | one UE8M0 byte per 64 nope dims, 0-padded to 8 bytes].
  Scale per 64-dim block = 2^ceil(log2(max(amax, 1e-4) / 448)), codes = e4m3 RNE of x / scale.
- "bf16" / "fp32": the row in that dtype (a cast and a byte copy), so callers have one path.
Every byte of a record past its content, up to `cache.shape[1]`, is written as 0 (as the
codec's zero-initialised records); bytes past `cache.shape[1]` (stride(0) may be larger) and
rows with slot -1 are never touched.

Issue 25 (launches of a prefill step): `kv_store` also takes `RingSlots`, the window ring's
slot formula that its kernel evaluates per token (one launch a layer, no torch ops), and
`kv_gather` has a workspace form: records gathered straight into given rows of a workspace,
their slots offset in-kernel (a page base, or a per-token ring base), plus fresh rows encoded
and decoded in registers as a store-then-gather would give them: a prefill chunk's workspace
in one launch instead of ~8 torch ops and kernels.

Kernels: one program per block of BLOCK_T tokens (store) or BLOCK_N slots (gather), the whole
row in registers (the codec pieces: kernels/kv_record.py). An fp8 row is a [BLOCK_C, 64] tile
of nope blocks (amax per block, then the codes) plus its rope bytes; a bf16/fp32 row is a byte
vector whose byte k comes from element k // W (W bytes per element), so every store is one
contiguous byte run per record. All roundings are integer ops (kernels/jit_helpers.py:
`bf16_rne`, `pow2_ceil_exp`, `e4m3_bits`) and bf16 inputs/outputs travel as int16 bits, so the
bytes equal the torch codec's on the GPU and under the interpreter alike (which truncates
float -> bf16 casts).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4.ops.kv_codec import decode_rows, encode_rows
from kernels.kv_record import read_records, round_trip_rows, write_records
from kernels.registry import register_op
from kernels.specialize import sizes_vary

FORMATS = ("fp8_ue8m0", "bf16", "fp32")
_ELEM_BYTES = {"bf16": 2, "fp32": 4}


def min_entry_bytes(fmt: str, dim: int, rope_dim: int) -> int:
    """Smallest record that holds one row in `fmt` (the codec's content plus fp8 scale pad)."""
    if fmt == "fp8_ue8m0":
        nope = dim - rope_dim
        return nope + 2 * rope_dim + (-(-nope // 64) + 7) // 8 * 8
    if fmt in _ELEM_BYTES:
        return dim * _ELEM_BYTES[fmt]
    raise ValueError(f"unknown KV entry format {fmt!r}; use one of {FORMATS}")


class RingSlots(NamedTuple):
    """Window ring slots that `kv_store` computes in its kernel (issue 25: no torch op per
    layer or ring size): token t's row goes to KV slot base[t] + positions[t] % ring, unless a
    later token of its request in this step takes that ring row (positions[t] < ends[req] -
    ring, req = token_to_req[t]): then it is not stored."""

    positions: torch.Tensor  # [T] int64
    token_to_req: torch.Tensor  # [T] int32 (-1 indexes the last request, as in torch)
    ends: torch.Tensor  # [B] int64: one past each request's last position this step
    base: torch.Tensor  # [T] int32: the layer's ring page (KV slot) of each token's request;
    # any stride (a step of one request may pass its one base as a stride-0 view)
    ring: int  # ring rows

    def slots(self) -> torch.Tensor:
        """[T] int64 KV slots, -1 = not stored (the kernel's formula in torch)."""
        keep = self.positions >= self.ends[self.token_to_req.long()] - self.ring  # [T] bool
        return torch.where(keep, self.base.long() + self.positions % self.ring, -1)


@triton.jit(**sizes_vary("T"))
def _store_kernel(
    # Pointers: rows [T, D] (fp32, or bf16 as int16); slots [T] (-1 = skip); cache [S, ENTRY] u8
    rows_ptr, slot_ptr, cache_ptr,
    # Sizes and strides (elements of rows, bytes of cache)
    T, stride_row, stride_cache,
    # Meta-parameters
    D: tl.constexpr, ROPE: tl.constexpr,
    ENTRY: tl.constexpr, USED: tl.constexpr,  # record bytes (cache.shape[1]); content bytes
    FMT: tl.constexpr,  # 0 fp8_ue8m0, 1 bf16, 2 fp32
    IN_BF16: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,  # fp8: nope blocks of 64 (power of two >= their number)
    BLOCK_B: tl.constexpr,  # fp8: rope bytes; bf16/fp32: row bytes (power of two >= them)
    BLOCK_Z: tl.constexpr,  # zero tail of the record (power of two >= its length)
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + t, mask=t < T, other=-1)
    write_records(rows_ptr + t.to(tl.int64) * stride_row,
                  cache_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_cache, slot >= 0,
                  D, ROPE, ENTRY, USED, FMT, IN_BF16, BLOCK_C, BLOCK_B, BLOCK_Z)  # fmt: skip


@triton.jit(**sizes_vary("T", "B"))
def _ring_store_kernel(
    # Pointers: rows [T, D]; positions [T] i64, token_to_req [T] i32, ends [B] i64, base [T] i32
    # (`RingSlots`); cache [S, ENTRY] u8
    rows_ptr, pos_ptr, req_ptr, end_ptr, base_ptr, cache_ptr,
    T, B, ring, stride_base, stride_row, stride_cache,
    D: tl.constexpr, ROPE: tl.constexpr, ENTRY: tl.constexpr, USED: tl.constexpr,
    FMT: tl.constexpr, IN_BF16: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_Z: tl.constexpr,  # as `_store_kernel`'s
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = t < T
    pos = tl.load(pos_ptr + t, mask=in_t, other=0).to(tl.int64)
    req = tl.load(req_ptr + t, mask=in_t, other=0).to(tl.int64)
    req = tl.where(req < 0, req + B, req)
    keep = in_t & (pos >= tl.load(end_ptr + req, mask=in_t, other=0) - ring)
    base = tl.load(base_ptr + t.to(tl.int64) * stride_base, mask=keep, other=0).to(tl.int64)
    slot = base + pos % ring  # positions >= 0: C's % is torch's
    write_records(rows_ptr + t.to(tl.int64) * stride_row, cache_ptr + slot * stride_cache, keep,
                  D, ROPE, ENTRY, USED, FMT, IN_BF16, BLOCK_C, BLOCK_B, BLOCK_Z)  # fmt: skip


@triton.jit(**sizes_vary("N"))
def _gather_kernel(
    # Pointers: cache [S, >= record] u8; slots [N] (-1 = zeros); out [N, D] (bf16 as int16)
    cache_ptr, slot_ptr, out_ptr,
    # Sizes and strides (bytes of cache, elements of out)
    N, stride_cache, stride_out,
    # Meta-parameters
    D: tl.constexpr, ROPE: tl.constexpr,
    FMT: tl.constexpr,  # 0 fp8_ue8m0, 1 bf16, 2 fp32
    OUT_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,  # fp8: nope blocks of 64
    BLOCK_E: tl.constexpr,  # fp8: rope elements; bf16/fp32: row elements
):  # fmt: skip
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = n < N
    slot = tl.load(slot_ptr + n, mask=in_n, other=-1)
    read_records(cache_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_cache, slot >= 0,
                 out_ptr + n.to(tl.int64) * stride_out, in_n,
                 D, ROPE, FMT, OUT_BF16, BLOCK_C, BLOCK_E)  # fmt: skip


@triton.jit(**sizes_vary("N", "F"))
def _workspace_gather_kernel(
    # Pointers: cache [S, >= record] u8; slots [N] (-1 = zeros), out_rows [N]; base table [*]
    # (any stride) and its index [N]; fresh rows [F, D] (fp32, or bf16 as int16), fresh_rows
    # [F]; out [M, D] (bf16 as int16)
    cache_ptr, slot_ptr, dst_ptr, base_ptr, base_idx_ptr, fresh_ptr, fresh_dst_ptr, out_ptr,
    N, F, slot_offset, stride_base, stride_cache, stride_fresh, stride_out,
    D: tl.constexpr, ROPE: tl.constexpr, FMT: tl.constexpr, IN_BF16: tl.constexpr,
    OUT_BF16: tl.constexpr,
    HAS_DST: tl.constexpr, HAS_BASE: tl.constexpr, HAS_FRESH_DST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr,  # as `_gather_kernel`'s
):  # fmt: skip
    # programs [0, cdiv(N)) decode cached records, the rest round-trip fresh rows
    pid = tl.program_id(0)
    num_cached = tl.cdiv(N, BLOCK_N)
    if pid < num_cached:
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        in_n = n < N
        slot = tl.load(slot_ptr + n, mask=in_n, other=-1).to(tl.int64)
        ok = slot >= 0
        slot += slot_offset
        if HAS_BASE:
            at = tl.load(base_idx_ptr + n, mask=ok, other=0).to(tl.int64)
            slot += tl.load(base_ptr + at * stride_base, mask=ok, other=0).to(tl.int64)
        if HAS_DST:
            row = tl.load(dst_ptr + n, mask=in_n, other=0).to(tl.int64)
        else:
            row = n.to(tl.int64)
        read_records(cache_ptr + tl.where(ok, slot, 0) * stride_cache, ok,
                     out_ptr + row * stride_out, in_n, D, ROPE, FMT, OUT_BF16, BLOCK_C,
                     BLOCK_E)  # fmt: skip
    else:
        f = (pid - num_cached) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_f = f < F
        if HAS_FRESH_DST:
            row = tl.load(fresh_dst_ptr + f, mask=in_f, other=0).to(tl.int64)
        else:
            row = (N + f).to(tl.int64)
        round_trip_rows(fresh_ptr + f.to(tl.int64) * stride_fresh, out_ptr + row * stride_out,
                        in_f, D, ROPE, FMT, IN_BF16, OUT_BF16, BLOCK_C, BLOCK_E)  # fmt: skip


def _block_rows(num_rows: int, width: int, on_gpu: bool) -> int:
    """Rows per program: ~4K elements on the GPU, fewer for small batches (more programs);
    up to 8K under the interpreter, where each program costs Python overhead."""
    per_prog = max(1, (4096 if on_gpu else 8192) // triton.next_power_of_2(width))
    want = triton.cdiv(num_rows, 1024) if on_gpu else num_rows
    return min(per_prog, triton.next_power_of_2(max(1, want)))


def _check(cache, slots, fmt, dim, rope_dim):
    min_bytes = min_entry_bytes(fmt, dim, rope_dim)  # raises on an unknown format
    assert cache.dtype == torch.uint8 and cache.dim() == 2 and cache.stride(1) == 1, cache.shape
    assert cache.shape[1] >= min_bytes, (cache.shape, fmt, min_bytes)
    assert slots.dim() == 1 and slots.dtype in (torch.int32, torch.int64), slots.dtype
    if fmt == "fp8_ue8m0":
        assert 0 <= rope_dim < dim, (dim, rope_dim)


def _blocks(fmt: str, dim: int, rope_dim: int) -> tuple[int, int, int]:
    """(BLOCK_C nope blocks, BLOCK_E row or rope elements, register width) of a decoded row."""
    if fmt == "fp8_ue8m0":
        block_c = triton.next_power_of_2(-(-(dim - rope_dim) // 64))
        block_e = triton.next_power_of_2(max(1, rope_dim))
        return block_c, block_e, block_c * 64 + block_e
    block_e = triton.next_power_of_2(dim)
    return 1, block_e, block_e * _ELEM_BYTES[fmt]


def kv_store(
    rows: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor | RingSlots,
    *,
    fmt: str,
    rope_dim: int = 64,
) -> None:
    """rows [T, D] bf16/fp32 (stride(1) == 1) -> records of `cache` [num_slots, entry_bytes]
    uint8 at rows `slots` [T] int32/int64 (-1 = skip; no duplicates, all < num_slots), byte
    for byte as `kv_codec.encode_rows(rows, fmt, cache.shape[1], rope_dim)`. `slots` may be a
    `RingSlots` instead (contiguous tensors): the kernel computes each row's slot."""
    ring = slots if isinstance(slots, RingSlots) else None
    num_rows, dim = rows.shape
    _check(cache, slots if ring is None else ring.base, fmt, dim, rope_dim)
    assert rows.dtype in (torch.bfloat16, torch.float32) and rows.stride(1) == 1, rows.dtype
    if ring is not None:
        assert all(x.dim() == 1 for x in ring[:4]), "RingSlots: 1-D tensors"
        assert all(x.is_contiguous() for x in ring[:3]), "RingSlots: dense positions and ends"
        assert ring.positions.shape[0] == ring.token_to_req.shape[0] == num_rows, rows.shape
    assert (slots if ring is None else ring.base).shape[0] == num_rows, rows.shape
    if num_rows == 0:
        return
    nope = dim - rope_dim
    if fmt == "fp8_ue8m0":
        block_c = triton.next_power_of_2(-(-nope // 64))
        block_b = triton.next_power_of_2(max(1, 2 * rope_dim))
        used, width = nope + 2 * rope_dim + -(-nope // 64), block_c * 64 + block_b
    else:
        block_c, used = 1, dim * _ELEM_BYTES[fmt]
        block_b = width = triton.next_power_of_2(used)
    block_t = _block_rows(num_rows, width, rows.is_cuda)
    is_bf16 = rows.dtype == torch.bfloat16
    meta = dict(D=dim, ROPE=rope_dim, ENTRY=cache.shape[1], USED=used, FMT=FORMATS.index(fmt),
                IN_BF16=is_bf16, BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_B=block_b,
                BLOCK_Z=triton.next_power_of_2(max(1, cache.shape[1] - used)), num_warps=4)  # fmt: skip
    grid, src = (triton.cdiv(num_rows, block_t),), rows.view(torch.int16) if is_bf16 else rows
    if ring is None:
        _store_kernel[grid](src, slots, cache, num_rows, rows.stride(0), cache.stride(0), **meta)
    else:
        _ring_store_kernel[grid](src, ring.positions, ring.token_to_req, ring.ends, ring.base,
                                   cache, num_rows, ring.ends.shape[0], ring.ring,
                                   ring.base.stride(0), rows.stride(0), cache.stride(0),
                                   **meta)  # fmt: skip


def kv_gather(
    cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    fmt: str,
    dim: int,
    rope_dim: int = 64,
    out_dtype: torch.dtype = torch.bfloat16,
    slot_offset: int = 0,
    slot_base: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
    fresh_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Records of `cache` [num_slots, entry_bytes] uint8 at `slots` [N] int32/int64 -> rows
    [N, dim] in out_dtype, decoded as `kv_codec.decode_rows`; rows with slot < 0 are zeros.
    fp8_ue8m0 and bf16 rows are exact in bf16 (e4m3 x 2^k, bf16 rope).

    Workspace form (a prefill chunk's workspace in one launch, issue 25): a valid slot is
    slots[n] + slot_offset (+ table[index[n]] with slot_base = (table [*] any stride, index
    [N])); row n is
    written to out [M, dim] (out_dtype, stride(1) == 1) at out_rows[n] (default n, a new
    [N + F, dim] when out is None); fresh rows [F, dim] bf16/fp32 go to out_rows fresh_rows[f]
    (default N + f) as `kv_store` then `kv_gather` would give them (the cache untouched).
    Returns out."""
    _check(cache, slots, fmt, dim, rope_dim)
    assert out_dtype in (torch.bfloat16, torch.float16, torch.float32), out_dtype
    num_rows, num_fresh = slots.shape[0], 0 if fresh is None else fresh.shape[0]
    if fresh is not None:
        assert fresh.shape[1] == dim and fresh.stride(1) == 1, fresh.shape
        assert fresh.dtype in (torch.bfloat16, torch.float32), fresh.dtype
    if out is None:
        out = torch.empty(num_rows + num_fresh, dim, dtype=out_dtype, device=cache.device)
    assert out.dtype == out_dtype and out.shape[1] == dim and out.stride(1) == 1, out.shape
    if num_rows + num_fresh == 0:
        return out
    block_c, block_e, width = _blocks(fmt, dim, rope_dim)
    block_n = _block_rows(num_rows + num_fresh, width, cache.is_cuda)
    is_bf16 = out_dtype == torch.bfloat16
    dst = out.view(torch.int16) if is_bf16 else out
    meta = dict(D=dim, ROPE=rope_dim, FMT=FORMATS.index(fmt), OUT_BF16=is_bf16,
                BLOCK_N=block_n, BLOCK_C=block_c, BLOCK_E=block_e, num_warps=4)  # fmt: skip
    plain = slot_offset == 0 and slot_base is None and out_rows is None and fresh is None
    if plain:
        _gather_kernel[(triton.cdiv(num_rows, block_n),)](
            cache, slots, dst, num_rows, cache.stride(0), out.stride(0), **meta
        )
        return out
    table, index = slot_base if slot_base is not None else (slots, slots)  # unread if absent
    for rows_of in (slots, out_rows, index, fresh_rows):  # [N] / [F] index vectors, dense
        assert rows_of is None or (rows_of.dim() == 1 and rows_of.is_contiguous()), rows_of
    in_bf16 = fresh is not None and fresh.dtype == torch.bfloat16
    fresh_src = slots if fresh is None else fresh.view(torch.int16) if in_bf16 else fresh
    grid = (triton.cdiv(num_rows, block_n) + triton.cdiv(num_fresh, block_n),)
    _workspace_gather_kernel[grid](
        cache, slots, slots if out_rows is None else out_rows, table, index, fresh_src,
        slots if fresh_rows is None else fresh_rows, dst,
        num_rows, num_fresh, slot_offset, table.stride(0), cache.stride(0),
        0 if fresh is None else fresh.stride(0), out.stride(0),
        IN_BF16=in_bf16, HAS_DST=out_rows is not None, HAS_BASE=slot_base is not None,
        HAS_FRESH_DST=fresh_rows is not None, **meta,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------- references


def kv_store_ref(rows, cache, slots, *, fmt, rope_dim=64):
    """`encode_rows` of the kept rows, assigned to their cache rows (the torch path)."""
    if isinstance(slots, RingSlots):
        slots = slots.slots()
    keep = slots >= 0
    kept = slots[keep].long()
    if kept.numel():  # NOTE: encode_rows cannot reshape an empty batch
        cache[kept] = encode_rows(rows[keep], fmt, cache.shape[1], rope_dim)


def kv_gather_ref(cache, slots, *, fmt, dim, rope_dim=64, out_dtype=torch.bfloat16,
                  slot_offset=0, slot_base=None, out=None, out_rows=None, fresh=None,
                  fresh_rows=None):  # fmt: skip
    """Index, `decode_rows`, zeros where slot < 0, cast; into `out` rows, then the fresh rows'
    `encode_rows` + `decode_rows` (the workspace form, see `kv_gather`)."""
    num_rows, num_fresh = slots.shape[0], 0 if fresh is None else fresh.shape[0]
    if out is None:
        out = torch.empty(num_rows + num_fresh, dim, dtype=out_dtype, device=cache.device)
    if num_rows:
        valid = slots >= 0  # [N]
        at = slots.long() + slot_offset
        if slot_base is not None:
            table, index = slot_base
            at = at + table[torch.where(valid, index, 0).long()].long()
        rows = decode_rows(cache[torch.where(valid, at, 0)], fmt, dim, rope_dim)  # [N, dim] fp32
        rows = torch.where(valid[:, None], rows, 0.0).to(out_dtype)
        out[slice(0, num_rows) if out_rows is None else out_rows.long()] = rows
    if num_fresh:  # NOTE: encode_rows cannot reshape an empty batch
        records = encode_rows(fresh, fmt, cache.shape[1], rope_dim)
        rows = decode_rows(records, fmt, dim, rope_dim).to(out_dtype)
        at = slice(num_rows, num_rows + num_fresh) if fresh_rows is None else fresh_rows.long()
        out[at] = rows
    return out


register_op("kv_store", kv_store, kv_store_ref, family="kv_store")
register_op("kv_gather", kv_gather, kv_gather_ref, family="kv_store")
