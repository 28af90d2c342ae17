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

Kernels: one program per block of BLOCK_T tokens (store) or BLOCK_N slots (gather), the whole
row in registers. An fp8 row is a [BLOCK_C, 64] tile of nope blocks (amax per block, then the
codes) plus its rope bytes; a bf16/fp32 row is a byte vector whose byte k comes from element
k // W (W bytes per element), so every store is one contiguous byte run per record. All
roundings are integer ops (kernels/jit_helpers.py: `bf16_rne`, `kv_fp8_encode`, `e4m3_bits`)
and bf16 inputs/outputs travel as int16 bits, so the bytes equal the torch codec's on the GPU
and under the interpreter alike (which truncates float -> bf16 casts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4.ops.kv_codec import decode_rows, encode_rows
from kernels.jit_helpers import bf16_rne, kv_fp8_decode, kv_fp8_encode
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


@triton.jit
def load_f32(ptr, mask, IN_BF16: tl.constexpr):
    """fp32 values at `ptr` (fp32 rows, or bf16 rows viewed as int16: widened bit-exactly)."""
    if IN_BF16:
        bits = tl.load(ptr, mask=mask, other=0).to(tl.int32) << 16
        val = bits.to(tl.float32, bitcast=True)
    else:  # one return: the compiler checks every return's type, pruned branches too
        val = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    return val


@triton.jit
def load_bits(ptr, mask, W: tl.constexpr):
    """Little-endian W-byte words at `ptr` (uint8) as int32."""
    bits = tl.load(ptr, mask=mask, other=0).to(tl.int32)
    for b in tl.static_range(1, W):
        bits |= tl.load(ptr + b, mask=mask, other=0).to(tl.int32) << (8 * b)
    return bits


@triton.jit
def load_fp8_records(rec, ok, NOPE: tl.constexpr, ROPE: tl.constexpr, BLOCK_C: tl.constexpr,
                     BLOCK_E: tl.constexpr):  # fmt: skip
    """fp8_ue8m0 records at `rec` [N] (read where `ok`) -> (e4m3 codes [N, BLOCK_C, 64] uint8,
    UE8M0 bytes [N, BLOCK_C] int32, rope [N, BLOCK_E] fp32 (its bf16 bits widened)); masked
    rows and columns read as 0 (kv_gather's and kv_workspace's)."""
    c = tl.arange(0, BLOCK_C)
    col = c[:, None] * 64 + tl.arange(0, 64)[None, :]  # [BLOCK_C, 64]
    codes = tl.load(rec[:, None, None] + col[None, :, :],
                    mask=ok[:, None, None] & (col < NOPE)[None, :, :], other=0)  # fmt: skip
    e = tl.load(rec[:, None] + (NOPE + 2 * ROPE) + c[None, :],
                mask=ok[:, None] & (c * 64 < NOPE)[None, :], other=0)  # fmt: skip
    j = tl.arange(0, BLOCK_E)
    rope = load_bits(rec[:, None] + NOPE + 2 * j[None, :], ok[:, None] & (j < ROPE)[None, :], 2)
    return codes, e.to(tl.int32), (rope << 16).to(tl.float32, bitcast=True)


@triton.jit
def store_out(ptr, x, mask, OUT_BF16: tl.constexpr):
    """fp32 values into the output row (bf16 output as int16 bits, rounded to nearest even)."""
    if OUT_BF16:
        bits = bf16_rne(x).to(tl.int32, bitcast=True) >> 16
        tl.store(ptr, bits.to(tl.int16), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_records(
    src, dst, ok,  # [BLOCK_T] row starts (rows_ptr + t * stride), record starts, store or not
    D: tl.constexpr, ROPE: tl.constexpr, ENTRY: tl.constexpr, USED: tl.constexpr,
    FMT: tl.constexpr, IN_BF16: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_Z: tl.constexpr,
):  # fmt: skip
    """Rows `src` -> their records at `dst` where `ok` (kv_store's and kv_workspace's)."""
    k = tl.arange(0, BLOCK_B)
    if FMT == 0:
        NOPE: tl.constexpr = D - ROPE
        NBLK: tl.constexpr = (NOPE + 63) // 64
        col = tl.arange(0, BLOCK_C)[:, None] * 64 + tl.arange(0, 64)[None, :]  # [BLOCK_C, 64]
        mk = ok[:, None, None] & (col < NOPE)[None, :, :]
        x = load_f32(src[:, None, None] + col[None, :, :], mk, IN_BF16)  # [BLOCK_T, BLOCK_C, 64]
        codes, e = kv_fp8_encode(x)
        tl.store(dst[:, None, None] + col[None, :, :], codes.to(tl.uint8), mask=mk)
        # rope byte k = low (k even) or high byte of the bf16 of element NOPE + k // 2
        mk_r = ok[:, None] & (k < 2 * ROPE)[None, :]
        r = bf16_rne(load_f32(src[:, None] + NOPE + k[None, :] // 2, mk_r, IN_BF16))
        rb = (r.to(tl.int32, bitcast=True) >> (16 + 8 * (k[None, :] % 2))) & 0xFF
        tl.store(dst[:, None] + NOPE + k[None, :], rb.to(tl.uint8), mask=mk_r)
        c = tl.arange(0, BLOCK_C)
        tl.store(dst[:, None] + (NOPE + 2 * ROPE) + c[None, :], (e + 127).to(tl.uint8),
                 mask=ok[:, None] & (c < NBLK)[None, :])  # fmt: skip
    else:
        W: tl.constexpr = 2 if FMT == 1 else 4
        mk = ok[:, None] & (k < D * W)[None, :]
        x = load_f32(src[:, None] + k[None, :] // W, mk, IN_BF16)  # [BLOCK_T, BLOCK_B]
        if FMT == 1:
            bits = bf16_rne(x).to(tl.int32, bitcast=True) >> 16
        else:
            bits = x.to(tl.int32, bitcast=True)
        byte = (bits >> (8 * (k[None, :] % W))) & 0xFF
        tl.store(dst[:, None] + k[None, :], byte.to(tl.uint8), mask=mk)
    if ENTRY > USED:  # scale pad and record tail: zeros, as the codec's fresh records
        z = tl.arange(0, BLOCK_Z)
        tl.store(dst[:, None] + USED + z[None, :], tl.zeros([BLOCK_T, BLOCK_Z], tl.uint8),
                 mask=ok[:, None] & (z < ENTRY - USED)[None, :])  # fmt: skip


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
    src = rows_ptr + t.to(tl.int64) * stride_row  # [BLOCK_T] row starts
    dst = cache_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_cache  # [BLOCK_T] record starts
    store_records(src, dst, slot >= 0, D, ROPE, ENTRY, USED, FMT, IN_BF16, BLOCK_T, BLOCK_C,
                  BLOCK_B, BLOCK_Z)  # fmt: skip


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
    ok = slot >= 0
    src = cache_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_cache  # [BLOCK_N]
    dst = out_ptr + n.to(tl.int64) * stride_out  # [BLOCK_N]
    j = tl.arange(0, BLOCK_E)
    if FMT == 0:
        NOPE: tl.constexpr = D - ROPE
        col = tl.arange(0, BLOCK_C)[:, None] * 64 + tl.arange(0, 64)[None, :]  # [BLOCK_C, 64]
        codes, e, rope = load_fp8_records(src, ok, NOPE, ROPE, BLOCK_C, BLOCK_E)
        store_out(dst[:, None, None] + col[None, :, :], kv_fp8_decode(codes, e),
                  in_n[:, None, None] & (col < NOPE)[None, :, :], OUT_BF16)  # fmt: skip
        store_out(dst[:, None] + NOPE + j[None, :], rope, in_n[:, None] & (j < ROPE)[None, :],
                  OUT_BF16)  # fmt: skip
    else:
        W: tl.constexpr = 2 if FMT == 1 else 4
        mk = ok[:, None] & (j < D)[None, :]
        bits = load_bits(src[:, None] + W * j[None, :], mk, W)
        if FMT == 1:
            bits = bits << 16
        store_out(dst[:, None] + j[None, :], bits.to(tl.float32, bitcast=True),
                  in_n[:, None] & (j < D)[None, :], OUT_BF16)  # fmt: skip


def block_rows(num_rows: int, width: int, on_gpu: bool) -> int:
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


@dataclass(frozen=True)
class RecordTiles:
    """A format's tile sizes: fp8 nope blocks (`block_c`), a record's content bytes (`used`),
    the store's record tile (`block_b` bytes) and the decode's row tile (`block_e` elements),
    and each one's register width (what `block_rows` divides)."""

    block_c: int
    block_b: int
    block_e: int
    used: int
    store_width: int
    gather_width: int


def record_tiles(fmt: str, dim: int, rope_dim: int) -> RecordTiles:
    """The tiles of kv_store's, kv_gather's and kv_workspace's kernels for rows of `dim`."""
    if fmt == "fp8_ue8m0":
        blocks = -(-(dim - rope_dim) // 64)
        block_c = triton.next_power_of_2(blocks)
        block_b = triton.next_power_of_2(max(1, 2 * rope_dim))
        block_e = triton.next_power_of_2(max(1, rope_dim))
        return RecordTiles(block_c, block_b, block_e, dim - rope_dim + 2 * rope_dim + blocks,
                           block_c * 64 + block_b, block_c * 64 + block_e)  # fmt: skip
    used, block_e = dim * _ELEM_BYTES[fmt], triton.next_power_of_2(dim)
    block_b = triton.next_power_of_2(used)
    return RecordTiles(1, block_b, block_e, used, block_b, block_e * _ELEM_BYTES[fmt])


def kv_store(
    rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, *, fmt: str, rope_dim: int = 64
) -> None:
    """rows [T, D] bf16/fp32 (stride(1) == 1) -> records of `cache` [num_slots, entry_bytes]
    uint8 at rows `slots` [T] int32/int64 (-1 = skip; no duplicates, all < num_slots), byte
    for byte as `kv_codec.encode_rows(rows, fmt, cache.shape[1], rope_dim)`."""
    num_rows, dim = rows.shape
    _check(cache, slots, fmt, dim, rope_dim)
    assert rows.dtype in (torch.bfloat16, torch.float32) and rows.stride(1) == 1, rows.dtype
    assert slots.shape[0] == num_rows, (slots.shape, rows.shape)
    if num_rows == 0:
        return
    tiles = record_tiles(fmt, dim, rope_dim)
    block_t = block_rows(num_rows, tiles.store_width, rows.is_cuda)
    is_bf16 = rows.dtype == torch.bfloat16
    _store_kernel[(triton.cdiv(num_rows, block_t),)](
        rows.view(torch.int16) if is_bf16 else rows, slots, cache,
        num_rows, rows.stride(0), cache.stride(0),
        D=dim, ROPE=rope_dim, ENTRY=cache.shape[1], USED=tiles.used, FMT=FORMATS.index(fmt),
        IN_BF16=is_bf16, BLOCK_T=block_t, BLOCK_C=tiles.block_c, BLOCK_B=tiles.block_b,
        BLOCK_Z=triton.next_power_of_2(max(1, cache.shape[1] - tiles.used)), num_warps=4,
    )  # fmt: skip


def kv_gather(
    cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    fmt: str,
    dim: int,
    rope_dim: int = 64,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Records of `cache` [num_slots, entry_bytes] uint8 at `slots` [N] int32/int64 -> rows
    [N, dim] in out_dtype, decoded as `kv_codec.decode_rows`; rows with slot < 0 are zeros.
    fp8_ue8m0 and bf16 rows are exact in bf16 (e4m3 x 2^k, bf16 rope)."""
    _check(cache, slots, fmt, dim, rope_dim)
    assert out_dtype in (torch.bfloat16, torch.float16, torch.float32), out_dtype
    num_rows = slots.shape[0]
    out = torch.empty(num_rows, dim, dtype=out_dtype, device=cache.device)  # [N, dim]
    if num_rows == 0:
        return out
    tiles = record_tiles(fmt, dim, rope_dim)
    block_n = block_rows(num_rows, tiles.gather_width, cache.is_cuda)
    is_bf16 = out_dtype == torch.bfloat16
    _gather_kernel[(triton.cdiv(num_rows, block_n),)](
        cache, slots, out.view(torch.int16) if is_bf16 else out,
        num_rows, cache.stride(0), out.stride(0),
        D=dim, ROPE=rope_dim, FMT=FORMATS.index(fmt), OUT_BF16=is_bf16,
        BLOCK_N=block_n, BLOCK_C=tiles.block_c, BLOCK_E=tiles.block_e, num_warps=4,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------- references


def kv_store_ref(rows, cache, slots, *, fmt, rope_dim=64):
    """`encode_rows` of the kept rows, assigned to their cache rows (the torch path)."""
    keep = slots >= 0
    kept = slots[keep].long()
    if kept.numel():  # NOTE: encode_rows cannot reshape an empty batch
        cache[kept] = encode_rows(rows[keep], fmt, cache.shape[1], rope_dim)


def kv_gather_ref(cache, slots, *, fmt, dim, rope_dim=64, out_dtype=torch.bfloat16):
    """Index, `decode_rows`, zeros where slot < 0, cast."""
    if slots.shape[0] == 0:
        return torch.empty(0, dim, dtype=out_dtype, device=cache.device)
    rows = decode_rows(cache[slots.clamp(min=0).long()], fmt, dim, rope_dim)  # [N, dim] fp32
    return torch.where((slots >= 0)[:, None], rows, 0.0).to(out_dtype)


register_op("kv_store", kv_store, kv_store_ref, family="kv_store")
register_op("kv_gather", kv_gather, kv_gather_ref, family="kv_store")
