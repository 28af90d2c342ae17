"""`@triton.jit` pieces of the KV entry codec (docs/model.md#entry-formats) that the kernels of
`kernels/kv_store.py` share: rows encoded into records, records decoded into rows, and fresh
rows encoded and decoded in registers (what storing then gathering them gives, without the
cache: a prefill chunk attends to its own rows that way, issue 25).

`FMT`: 0 fp8_ue8m0, 1 bf16, 2 fp32. Row pointers are element pointers (fp32, or bf16 as int16:
`IN_BF16` / `OUT_BF16`), record pointers byte pointers; each helper takes one pointer per row of
its block ([BLOCK] vectors) and a row mask. All roundings are integer ops (jit_helpers), so the
bytes and values equal `kv_codec`'s on the GPU and under the interpreter alike.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.jit_helpers import bf16_rne, e4m3_bits, pow2, pow2_ceil_exp


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
def store_out(ptr, x, mask, OUT_BF16: tl.constexpr):
    """fp32 values into the output row (bf16 output as int16 bits, rounded to nearest even)."""
    if OUT_BF16:
        bits = bf16_rne(x).to(tl.int32, bitcast=True) >> 16
        tl.store(ptr, bits.to(tl.int16), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _nope_cols(BLOCK_C: tl.constexpr):
    """[BLOCK_C, 64] channel of each (nope block, lane)."""
    return tl.arange(0, BLOCK_C)[:, None] * 64 + tl.arange(0, 64)[None, :]


@triton.jit
def _encode_nope(src, ok, NOPE: tl.constexpr, IN_BF16: tl.constexpr, BLOCK_C: tl.constexpr):
    """fp8_ue8m0 nope channels of the rows at `src` [BLOCK] -> (codes [BLOCK, BLOCK_C, 64] int32
    e4m3 bytes, e [BLOCK, BLOCK_C] int32: block scale 2^e = 2^ceil(log2(max(amax,1e-4)/448)))."""
    col = _nope_cols(BLOCK_C)
    x = load_f32(src[:, None, None] + col[None, :, :], ok[:, None, None] & (col < NOPE)[None, :, :],
                 IN_BF16)  # fmt: skip
    amax = tl.max(tl.abs(x), axis=2)  # [BLOCK, BLOCK_C]
    e = pow2_ceil_exp(tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0))
    return e4m3_bits(x * pow2(-e)[:, :, None]), e


@triton.jit
def _store_nope(dst, codes, scale, mask, NOPE: tl.constexpr, OUT_BF16: tl.constexpr,
                BLOCK_C: tl.constexpr):  # fmt: skip
    """e4m3 bytes codes [BLOCK, BLOCK_C, 64] uint8 times scale [BLOCK, BLOCK_C] fp32 -> the nope
    channels of the rows at `dst` [BLOCK] where mask."""
    col = _nope_cols(BLOCK_C)
    nope = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]
    store_out(dst[:, None, None] + col[None, :, :], nope,
              mask[:, None, None] & (col < NOPE)[None, :, :], OUT_BF16)  # fmt: skip


@triton.jit
def write_records(src, dst, ok, D: tl.constexpr, ROPE: tl.constexpr, ENTRY: tl.constexpr,
                  USED: tl.constexpr, FMT: tl.constexpr, IN_BF16: tl.constexpr,
                  BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_Z: tl.constexpr):  # fmt: skip
    """Rows at `src` [BLOCK] -> records at `dst` [BLOCK] where ok, as `kv_codec.encode_rows`
    (ENTRY record bytes, USED of them content, the rest zeros). fp8: BLOCK_C nope blocks and
    BLOCK_B rope bytes; bf16/fp32: BLOCK_B row bytes (byte k from element k // width)."""
    k = tl.arange(0, BLOCK_B)
    if FMT == 0:
        NOPE: tl.constexpr = D - ROPE
        col = _nope_cols(BLOCK_C)
        codes, e = _encode_nope(src, ok, NOPE, IN_BF16, BLOCK_C)
        tl.store(dst[:, None, None] + col[None, :, :], codes.to(tl.uint8),
                 mask=ok[:, None, None] & (col < NOPE)[None, :, :])  # fmt: skip
        # rope byte k = low (k even) or high byte of the bf16 of element NOPE + k // 2
        mk_r = ok[:, None] & (k < 2 * ROPE)[None, :]
        r = bf16_rne(load_f32(src[:, None] + NOPE + k[None, :] // 2, mk_r, IN_BF16))
        rb = (r.to(tl.int32, bitcast=True) >> (16 + 8 * (k[None, :] % 2))) & 0xFF
        tl.store(dst[:, None] + NOPE + k[None, :], rb.to(tl.uint8), mask=mk_r)
        c = tl.arange(0, BLOCK_C)
        tl.store(dst[:, None] + (NOPE + 2 * ROPE) + c[None, :], (e + 127).to(tl.uint8),
                 mask=ok[:, None] & (c < (NOPE + 63) // 64)[None, :])  # fmt: skip
    else:
        W: tl.constexpr = 2 if FMT == 1 else 4
        mk = ok[:, None] & (k < D * W)[None, :]
        x = load_f32(src[:, None] + k[None, :] // W, mk, IN_BF16)  # [BLOCK, BLOCK_B]
        if FMT == 1:
            bits = bf16_rne(x).to(tl.int32, bitcast=True) >> 16
        else:
            bits = x.to(tl.int32, bitcast=True)
        byte = (bits >> (8 * (k[None, :] % W))) & 0xFF
        tl.store(dst[:, None] + k[None, :], byte.to(tl.uint8), mask=mk)
    if ENTRY > USED:  # scale pad and record tail: zeros, as the codec's fresh records
        z = tl.arange(0, BLOCK_Z)
        tl.store(dst[:, None] + USED + z[None, :], tl.zeros([dst.shape[0], BLOCK_Z], tl.uint8),
                 mask=ok[:, None] & (z < ENTRY - USED)[None, :])  # fmt: skip


@triton.jit
def read_records(src, ok, dst, mask, D: tl.constexpr, ROPE: tl.constexpr, FMT: tl.constexpr,
                 OUT_BF16: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    """Records at `src` [BLOCK] (zeros where not ok) -> rows at `dst` [BLOCK] where mask, as
    `kv_codec.decode_rows`. fp8: BLOCK_E rope elements; bf16/fp32: BLOCK_E row elements."""
    j = tl.arange(0, BLOCK_E)
    if FMT == 0:
        NOPE: tl.constexpr = D - ROPE
        c = tl.arange(0, BLOCK_C)
        col = _nope_cols(BLOCK_C)
        codes = tl.load(src[:, None, None] + col[None, :, :],
                        mask=ok[:, None, None] & (col < NOPE)[None, :, :], other=0)  # fmt: skip
        e = tl.load(src[:, None] + (NOPE + 2 * ROPE) + c[None, :],
                    mask=ok[:, None] & (c * 64 < NOPE)[None, :], other=0)  # fmt: skip
        scale = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(e-127); 0 where masked
        _store_nope(dst, codes, scale, mask, NOPE, OUT_BF16, BLOCK_C)
        rope = load_bits(src[:, None] + NOPE + 2 * j[None, :], ok[:, None] & (j < ROPE)[None, :], 2)
        store_out(dst[:, None] + NOPE + j[None, :], (rope << 16).to(tl.float32, bitcast=True),
                  mask[:, None] & (j < ROPE)[None, :], OUT_BF16)  # fmt: skip
    else:
        W: tl.constexpr = 2 if FMT == 1 else 4
        bits = load_bits(src[:, None] + W * j[None, :], ok[:, None] & (j < D)[None, :], W)
        if FMT == 1:
            bits = bits << 16
        store_out(dst[:, None] + j[None, :], bits.to(tl.float32, bitcast=True),
                  mask[:, None] & (j < D)[None, :], OUT_BF16)  # fmt: skip


@triton.jit
def round_trip_rows(src, dst, mask, D: tl.constexpr, ROPE: tl.constexpr, FMT: tl.constexpr,
                    IN_BF16: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_C: tl.constexpr,
                    BLOCK_E: tl.constexpr):  # fmt: skip
    """Rows at `src` [BLOCK] -> rows at `dst` [BLOCK] where mask: `read_records` of the records
    `write_records` would write, in registers (the same codes, scales and bf16 roundings, then
    the same decode), blocks as `read_records`'."""
    j = tl.arange(0, BLOCK_E)
    if FMT == 0:
        NOPE: tl.constexpr = D - ROPE
        codes, e = _encode_nope(src, mask, NOPE, IN_BF16, BLOCK_C)
        _store_nope(dst, codes.to(tl.uint8), pow2(e), mask, NOPE, OUT_BF16, BLOCK_C)
        mk_r = mask[:, None] & (j < ROPE)[None, :]
        rope = bf16_rne(load_f32(src[:, None] + NOPE + j[None, :], mk_r, IN_BF16))
        store_out(dst[:, None] + NOPE + j[None, :], rope, mk_r, OUT_BF16)
    else:
        mk = mask[:, None] & (j < D)[None, :]
        x = load_f32(src[:, None] + j[None, :], mk, IN_BF16)
        if FMT == 1:
            x = bf16_rne(x)
        store_out(dst[:, None] + j[None, :], x, mk, OUT_BF16)
