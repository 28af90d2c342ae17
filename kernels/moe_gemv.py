"""Decode-sized MXFP4 MoE: the two grouped products as a batched GEMV on the CUDA cores.

At 1-128 tokens each routed expert sees one to three (token, slot) pairs, so `kernels.moe`'s
MMA tiles are mostly padding and its per-element nibble decode (shifts, a select, a scale
multiply, a cast, then a register shuffle into the MMA operand) bounds it far below the bytes'
roofline (175 us a layer at one token against 90 us for bf16). Here each program streams
BLOCK_N weight rows of one expert as stored (K contiguous: 16-byte loads of 32-bit words, eight
e2m1 codes each; no load-time relayout), upcasts two codes with a few integer operations and
accumulates BLOCK_N x 8*BLOCK_W products elementwise in fp32 for each of its BLOCK_M (1 or 2)
rows, reducing over K once after the loop. On the H200 (V4-Flash experts, top-6 of 256,
benchmarks/results/moe-mxfp4-h200.json): 57 / 578 / 2144 us at 1 / 16 / 64 tokens against
91 / 936 / 2296 us for bf16 experts and 177 / 1603 / 3927 us for the in-register kernel.

The upcast, on a 32-bit word w = bytes b0..b3 (low nibble = even column): its two 16-bit lanes
hold columns 0-3 and 4-7 as nibbles q = 0..3 (sign at bit 4q+3, e1 e0 m at 4q+2..4q). For each q
    p = ((w << (6 - 4q)) & 0x01C001C0) | ((w << (12 - 4q)) & 0x80008000)
(for q = 0, 1 one multiply of the masked nibbles by 2^(6-4q) + 2^(12-4q) makes both copies)
puts both lanes' code bits where bf16 keeps them (sign at 15, e1 e0 at the exponent's two low
bits, m at the mantissa's top), so each lane is the bf16 pattern of e2m1 * 2^-126 (exponent
field e: code e = 0 is the subnormal m/2 * 2^-126, which is why no select is needed). Each lane
becomes fp32 by one more operation (p << 16, p & 0xFFFF0000). The UE8M0 byte s enters as a
power of two, 2^126 * 2^(s - 127), either on each weight (then the same value
`dsv4.ops.quant.mxfp4_dequantize` returns) or, POST_SCALE (the default), on the sum of a
word's eight products with x carried times 2^64: 2^(s - 65) on the sum. Either way the products
are exact in fp32 and the outputs differ from the dequantise-then-GEMM reference only in
summation order (the powers of two fit fp32 for s <= 128, resp. 192: weights up to |12|, resp.
6 * 2^65, far above any checkpoint's).

The activation operand is permuted to match (`permute_columns`): xp [rows, 8, K/8] fp32 with
xp[r, c, j] = x[r, col(c, j)] (`column_map`), so the values met by code c of word j are
contiguous in j and load as wide as the weights. The first kernel writes h in that order too,
for the second.

Two weight layouts, one kernel each way (constexpr HALVES, chosen by the format):
- "mxfp4" (as stored): col(c, j) = 8j + c; a word lies in one 32-column scale group.
- "mxfp4_halves128" (kernels/moe_mxfp4.py `repack_halves`, the layout the MMA kernel reads
  above this path's sizes, so one copy of the experts serves every size): in each 128-column
  block byte t of the block holds column t (low nibble) and 64 + t (high nibble). Word j is
  block b = j // 16, m = j % 16, its bytes t = 0..3 columns 128b + 4m + t and 128b + 64 + 4m +
  t; code c = 4 lane + q is byte 2 lane + q // 2, the low nibble when q is even, so
      col(c, j) = 128b + 64 (q % 2) + 4m + 2 lane + q // 2.
  A word now meets two scale groups, 4b + m // 8 (its even codes) and 4b + 2 + m // 8 (odd):
  POST_SCALE keeps two sums a word, each times its own power of two (one more multiply a word
  and row; the step's 16 scale bytes a row still load at once and split in registers).
  Compiled for sm_90 (tools/moe_sass.py, gemv13 m1): 95 registers and 0.391 warp instructions
  a weight byte against 0.375 for the stored layout. The numerics are unchanged: every product
  exact in fp32, only the summation order differs from the dequantise-then-GEMM reference.

Steps (no host sync, CUDA-graph capturable): `moe_align` with BLOCK_M rows a tile; the x
permute (one launch); `_gemv13_kernel` (gate and up rows of a tile share the x values; SwiGLU
with the clamp; h permuted fp32 [P, 8, I/8], bf16-exact values); `_gemv2_kernel` (rows
[T*K, D] bf16, one per pair); `kernels.moe`'s combine. Grid: row tiles fastest, so the tiles of
an expert with several pairs read the same weight block at the same time (one DRAM read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.jit_helpers import bf16_rne, swiglu_bf16
from kernels.specialize import sizes_vary

# Average (token, slot) pairs an expert up to which `kernels.moe.moe_experts` takes this path
# for MXFP4 experts: 128 tokens of V4-Flash (top-6 of 256). On the H200 (benchmarks/results/
# moe-mxfp4-h200.json) the GEMV took 3.76 ms at 128 tokens against 4.88 ms for the in-register
# kernel, and 6.99 against 5.05 ms at 256.
GEMV_MAX_PAIRS_PER_EXPERT = 3.0
# The same bound for the "mxfp4_halves128" layout, whose MMA kernel (kernels/moe_mxfp4.py) is
# faster than the nibble-decoding one: 32 tokens of V4-Flash. H100, 2026-12-07: the halves
# GEMV 592 us at 16 tokens against 745 for the halves MMA kernel, 2216 against 1821 at 64.
HALVES_GEMV_MAX_PAIRS_PER_EXPERT = 0.75
# Each word's 8 products summed before its scale multiplies them (one multiply a word, not a
# weight); x and h are then carried times 2^64 so the products e2m1 * 2^-126 * x stay normal
# fp32 (exact for 2^-63 < |x| < 2^64; zeros exact). H200: 57 against 63 us at one token.
POST_SCALE_DEFAULT = True
_SIGN = tl.constexpr(-2147450880)  # 0x80008000 as int32: the two lanes' sign bits
_MAG = tl.constexpr(0x01C001C0)  # both lanes' e1 e0 m bits: bf16's exponent low bits, mantissa top
_HIGH = tl.constexpr(-65536)  # 0xFFFF0000
_CODE = tl.constexpr(-2118090304)  # 0x81C081C0: _MAG | _SIGN


@triton.jit
def _lanes(w, q: tl.constexpr):
    """Code q (0..3) of both 16-bit lanes of words w (int32) -> (low lane, high lane) as fp32
    e2m1 * 2^-126: columns 8j + q and 8j + 4 + q of word j."""
    if q < 2:  # one multiply makes both copies: (nibbles) * (2^(6-4q) + 2^(12-4q)), no carries
        p = ((w & (0x000F000F << (4 * q))) * ((1 << (6 - 4 * q)) + (1 << (12 - 4 * q)))) & _CODE
    else:  # right shift for the magnitude (arithmetic: the sign copies land outside _MAG)
        p = ((w >> (4 * q - 6)) & _MAG) | ((w << (12 - 4 * q)) & _SIGN)
    return (p << 16).to(tl.float32, bitcast=True), (p & _HIGH).to(tl.float32, bitcast=True)


@triton.jit
def _word_scales(s_rows, n_ok, k0, K, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                 POST_SCALE: tl.constexpr, HALVES: tl.constexpr):  # fmt: skip
    """The UE8M0 scales of the BLOCK_W words from column k0 as fp32 powers of two, [BLOCK_N,
    BLOCK_W] each: (the low nibbles', the high nibbles') (the same tensor for the stored layout,
    where a word lies in one 32-column group). 2^126 * 2^(s - 127) on each weight; POST_SCALE:
    2^-64 * 2^126 * 2^(s - 127) on the sum of a word's products (x is then x * 2^64: the
    products e2m1 * 2^-126 * x * 2^64 stay normal)."""
    bias: tl.constexpr = 62 if POST_SCALE else 126
    if HALVES:  # block b's groups 4b, 4b + 1 (low nibbles), 4b + 2, 4b + 3 (high): one load
        g = k0 // 32 + tl.arange(0, BLOCK_W // 4)
        sm = (g < K // 32)[None, :] & (n_ok[:, None])
        sb = tl.load(s_rows[:, None] + g[None, :], mask=sm, other=0).to(tl.int32) & 0xFF
        sb = ((sb + bias) << 23).to(tl.float32, bitcast=True)
        # [BLOCK_N, blocks, low / high, m // 8] -> the halves last, split
        sb = tl.permute(tl.reshape(sb, [BLOCK_N, BLOCK_W // 16, 2, 2]), (0, 1, 3, 2))
        lo, hi = tl.split(sb)  # [BLOCK_N, BLOCK_W // 16, 2]: a word octet's scale each
        lo = tl.reshape(tl.broadcast_to(tl.reshape(lo, [BLOCK_N, BLOCK_W // 8, 1]),
                                        [BLOCK_N, BLOCK_W // 8, 8]), [BLOCK_N, BLOCK_W])  # fmt: skip
        hi = tl.reshape(tl.broadcast_to(tl.reshape(hi, [BLOCK_N, BLOCK_W // 8, 1]),
                                        [BLOCK_N, BLOCK_W // 8, 8]), [BLOCK_N, BLOCK_W])  # fmt: skip
    else:
        g = k0 // 32 + tl.arange(0, BLOCK_W // 4)  # scale groups: 4 words each
        sm = (g < K // 32)[None, :] & (n_ok[:, None])
        sb = tl.load(s_rows[:, None] + g[None, :], mask=sm, other=0).to(tl.int32) & 0xFF
        lo = ((sb + bias) << 23).to(tl.float32, bitcast=True)
        lo = tl.reshape(tl.broadcast_to(lo[:, :, None], [BLOCK_N, BLOCK_W // 4, 4]),
                        [BLOCK_N, BLOCK_W])  # fmt: skip
        hi = lo
    return lo, hi


@triton.jit
def _fma_pair(acc, lo, hi, at_lo, at_hi, mask, FIRST: tl.constexpr):
    """acc + lo * x[at_lo] + hi * x[at_hi] (FIRST: without acc), fp32 [BLOCK_N, BLOCK_W]."""
    x_lo = tl.load(at_lo, mask=mask, other=0.0)
    if FIRST:
        acc = lo * x_lo
    else:
        acc += lo * x_lo
    return acc + hi * tl.load(at_hi, mask=mask, other=0.0)


@triton.jit
def _gemv_step(acc0, acc1, w_rows, s_rows, x0, x1, ok0, ok1, n_ok, k0, K, stride_xc,
               BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, TWO: tl.constexpr,
               POST_SCALE: tl.constexpr, HALVES: tl.constexpr):  # fmt: skip
    """acc0/acc1 [BLOCK_N, BLOCK_W] += the products of the 8*BLOCK_W columns from k0 with the
    permuted activation rows at x0 / x1 (scalar pointers; x1 only when TWO; ok0 / ok1 [BLOCK_N,
    BLOCK_W] whether the row is a pair): weight words at w_rows [BLOCK_N] (int32 pointers),
    UE8M0 scales at s_rows. HALVES: the words in the "mxfp4_halves128" layout (module doc)."""
    j = k0 // 8 + tl.arange(0, BLOCK_W)  # word index
    # NOTE: masked per 4-word scale group (K is a multiple of 32), so the mask is constant over
    # each thread's 16-byte load and the load vectorises
    j_ok = (j // 4) * 32 < K
    wm = n_ok[:, None] & j_ok[None, :]
    w = tl.load(w_rows[:, None] + j[None, :], mask=wm, other=0)
    s_even, s_odd = _word_scales(s_rows, n_ok, k0, K, BLOCK_N, BLOCK_W, POST_SCALE, HALVES)
    # NOTE: x loads [BLOCK_N, BLOCK_W] (every row's threads load the same values, from L1) in
    # the weight tile's layout: loaded [BLOCK_W] and broadcast, each went through shared memory
    # with a barrier (compiled for sm_90)
    xj = j[None, :] + 0 * ok0.to(tl.int32)
    # POST_SCALE: a word's sums of products; HALVES two, by code parity q % 2 (the low / high
    # nibbles: each its own scale group)
    even0, even1, odd0, odd1 = acc0, acc1, acc0, acc1
    for q in tl.static_range(4):
        lo, hi = _lanes(w, q)
        if not POST_SCALE:
            s = s_even if q % 2 == 0 else s_odd
            lo, hi = lo * s, hi * s
        at_lo, at_hi = q * stride_xc + xj, (q + 4) * stride_xc + xj
        # a POST_SCALE word sum starts at its first products (q 0; HALVES' odd sum: q 1)
        if HALVES and POST_SCALE and q % 2 == 1:
            odd0 = _fma_pair(odd0, lo, hi, x0 + at_lo, x0 + at_hi, wm & ok0, q == 1)
            if TWO:
                odd1 = _fma_pair(odd1, lo, hi, x1 + at_lo, x1 + at_hi, wm & ok1, q == 1)
        else:
            even0 = _fma_pair(even0, lo, hi, x0 + at_lo, x0 + at_hi, wm & ok0,
                              POST_SCALE and q == 0)  # fmt: skip
            if TWO:
                even1 = _fma_pair(even1, lo, hi, x1 + at_lo, x1 + at_hi, wm & ok1,
                                  POST_SCALE and q == 0)  # fmt: skip
    if not POST_SCALE:
        return even0, even1
    if HALVES:
        return acc0 + even0 * s_even + odd0 * s_odd, acc1 + even1 * s_even + odd1 * s_odd
    return acc0 + even0 * s_even, acc1 + even1 * s_even


@triton.jit(**sizes_vary("num_pairs"))
def _gemv13_kernel(
    # Pointers: xp [T, 8, D/8] fp32 (permuted x); sorted pair ids [P]; tile expert; w13 words
    # [E, 2I, D/8] int32 and UE8M0 scales [E, 2I, D/32] (uint8 view); out hp [P, 8, I/8] fp32
    xp_ptr, ids_ptr, tile_e_ptr, w_ptr, s_ptr, hp_ptr,
    num_pairs, D, INTER,
    stride_xt, stride_xc, stride_we, stride_wn, stride_se, stride_sn, stride_ht, stride_hc,
    limit,
    TOPK: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr, POST_SCALE: tl.constexpr, HALVES: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_e_ptr + pid_m)
    if e >= 0:
        # BLOCK_M (1 or 2) rows: row 1 reads row 0's x when it is padding (never stored)
        p0 = tl.load(ids_ptr + pid_m * BLOCK_M)
        p1 = tl.load(ids_ptr + pid_m * BLOCK_M + BLOCK_M - 1)
        ok0, ok1 = _row_ok(p0, p1, num_pairs, BLOCK_N, BLOCK_W)
        x0 = xp_ptr + (p0 // TOPK).to(tl.int64) * stride_xt
        x1 = xp_ptr + (p1 // TOPK).to(tl.int64) * stride_xt
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < INTER
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        gate_w, up_w = w_e + n.to(tl.int64) * stride_wn, w_e + (n + INTER).to(tl.int64) * stride_wn
        gate_s, up_s = s_e + n.to(tl.int64) * stride_sn, s_e + (n + INTER).to(tl.int64) * stride_sn
        g0 = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
        g1, u0, u1 = g0, g0, g0
        for k0 in range(0, D, 8 * BLOCK_W):
            g0, g1 = _gemv_step(g0, g1, gate_w, gate_s, x0, x1, ok0, ok1, n_ok, k0, D, stride_xc,
                                BLOCK_N, BLOCK_W, BLOCK_M == 2, POST_SCALE, HALVES)  # fmt: skip
            u0, u1 = _gemv_step(u0, u1, up_w, up_s, x0, x1, ok0, ok1, n_ok, k0, D, stride_xc,
                                BLOCK_N, BLOCK_W, BLOCK_M == 2, POST_SCALE, HALVES)  # fmt: skip
        _swiglu_store(g0, u0, hp_ptr + pid_m * BLOCK_M * stride_ht, n,
                      n_ok & (n * 0 + p0 < num_pairs), stride_hc, limit, HAS_LIMIT,
                      POST_SCALE, HALVES)  # fmt: skip
        if BLOCK_M == 2:
            _swiglu_store(g1, u1, hp_ptr + (pid_m * BLOCK_M + 1) * stride_ht, n,
                          n_ok & (n * 0 + p1 < num_pairs), stride_hc, limit, HAS_LIMIT,
                          POST_SCALE, HALVES)  # fmt: skip


@triton.jit
def _row_ok(p0, p1, num_pairs, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """Whether tile rows 0 and 1 are pairs (not padding), as [BLOCK_N, BLOCK_W] masks (the CPU
    interpreter rejects a tensor mask and-ed with a scalar)."""
    zero = tl.zeros([BLOCK_N, BLOCK_W], tl.int32)
    return zero + p0 < num_pairs, zero + p1 < num_pairs


@triton.jit
def _swiglu_store(acc_g, acc_u, h_row, n, mask, stride_hc, limit, HAS_LIMIT: tl.constexpr,
                  POST_SCALE: tl.constexpr, HALVES: tl.constexpr):  # fmt: skip
    h = swiglu_bf16(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), limit, HAS_LIMIT)  # [BLOCK_N]
    if POST_SCALE:  # the second GEMV's activation, times 2^64 (exact)
        h = h * 18446744073709551616.0
    # column n of h at [c, j] of the row's permuted [8, I/8], col(c, j) = n (`column_map`)
    if HALVES:  # n = 128b + 64h + 4m + 2 lane + t: c = 4 lane + 2t + h, j = 16b + m
        r = n % 128
        c = 4 * ((r % 4) // 2) + 2 * (r % 2) + r // 64
        j = 16 * (n // 128) + (r % 64) // 4
    else:  # n = 8j + c
        c, j = n % 8, n // 8
    tl.store(h_row + c * stride_hc + j, h, mask=mask)


@triton.jit(**sizes_vary("num_pairs"))
def _gemv2_kernel(
    # Pointers: hp [P, 8, I/8] fp32; sorted pair ids; tile expert; w2 words [E, D, I/8] int32,
    # scales [E, D, I/32]; out rows [T*K, D] bf16 (one per pair)
    hp_ptr, ids_ptr, tile_e_ptr, w_ptr, s_ptr, out_ptr,
    num_pairs, D, INTER,
    stride_ht, stride_hc, stride_we, stride_wn, stride_se, stride_sn, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    POST_SCALE: tl.constexpr, HALVES: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_e_ptr + pid_m)
    if e >= 0:
        p0 = tl.load(ids_ptr + pid_m * BLOCK_M)
        p1 = tl.load(ids_ptr + pid_m * BLOCK_M + BLOCK_M - 1)
        ok0, ok1 = _row_ok(p0, p1, num_pairs, BLOCK_N, BLOCK_W)
        h0 = hp_ptr + (pid_m * BLOCK_M).to(tl.int64) * stride_ht
        h1 = hp_ptr + (pid_m * BLOCK_M + BLOCK_M - 1).to(tl.int64) * stride_ht
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < D
        w_rows = w_ptr + e.to(tl.int64) * stride_we + n.to(tl.int64) * stride_wn
        s_rows = s_ptr + e.to(tl.int64) * stride_se + n.to(tl.int64) * stride_sn
        acc0 = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
        acc1 = acc0
        for k0 in range(0, INTER, 8 * BLOCK_W):
            acc0, acc1 = _gemv_step(acc0, acc1, w_rows, s_rows, h0, h1, ok0, ok1, n_ok, k0, INTER,
                                    stride_hc, BLOCK_N, BLOCK_W, BLOCK_M == 2,
                                    POST_SCALE, HALVES)  # fmt: skip
        out0 = bf16_rne(tl.sum(acc0, axis=1))
        tl.store(out_ptr + p0.to(tl.int64) * stride_out + n, out0.to(out_ptr.dtype.element_ty),
                 mask=n_ok & (n * 0 + p0 < num_pairs))  # fmt: skip
        if BLOCK_M == 2:
            out1 = bf16_rne(tl.sum(acc1, axis=1))
            tl.store(out_ptr + p1.to(tl.int64) * stride_out + n,
                     out1.to(out_ptr.dtype.element_ty),
                     mask=n_ok & (n * 0 + p1 < num_pairs))  # fmt: skip


# the formats this path reads: the stored layout and the re-packed "halves" one of K block 128
# (kernels/moe_mxfp4.py), which the MMA kernel serves above the GEMV's sizes
GEMV_FORMATS = ("mxfp4", "mxfp4_halves128")
HALVES_BLOCK = 128


def use_gemv(num_pairs: int, num_experts: int, format: str) -> bool:
    """Whether `moe_experts` takes this path: MXFP4 experts at decode sizes."""
    bound = HALVES_GEMV_MAX_PAIRS_PER_EXPERT if format == "mxfp4_halves128" else (
        GEMV_MAX_PAIRS_PER_EXPERT)  # fmt: skip
    return format in GEMV_FORMATS and num_pairs <= bound * num_experts


def gemv_config(num_pairs: int, num_experts: int, on_gpu: bool, format: str = "mxfp4") -> dict:
    """BLOCK_M: rows a tile (the tile's weights are upcast once for all of them); BLOCK_N:
    weight rows a program of w13 (gate and up rows each), BLOCK_N2 of w2; BLOCK_W: 32-bit words a row a K step."""
    if not on_gpu:  # interpreter: few, large programs (halves: a whole 128-column block a step)
        block_w = 8 if format == "mxfp4" else 16
        return dict(BLOCK_M=2, BLOCK_N=16, BLOCK_N2=16, BLOCK_W=block_w, num_warps=4)
    # NOTE: BLOCK_M is 1 or 2 (two accumulators; a 3-D [M, N, W] one compiled for sm_90 to a
    # shared-memory layout conversion on every step)
    # H200 sweep (bench_kernels_moe_gemv): this config was the best or within 0.1% at 1, 16 and 64
    # tokens, BLOCK_M 2 the better from 64 (2.14 against 2.17 ms)
    block_m = 1 if num_pairs <= 0.5 * num_experts else 2
    return dict(BLOCK_M=block_m, BLOCK_N=8, BLOCK_N2=16, BLOCK_W=64, num_warps=4)


def column_map(k: int, halves: bool = False) -> torch.Tensor:
    """col [8, K/8] int64: the column code c of word j upcasts (module doc). Stored layout:
    8j + c. Halves: word j of block b = j // 16, m = j % 16 holds bytes t = 2 lane + q // 2
    (lane = c // 4, q = c % 4) of columns 128b + 4m + t (low nibble, q even) and 128b + 64 +
    4m + t (high nibble, q odd)."""
    c = torch.arange(8)[:, None]
    j = torch.arange(k // 8)[None, :]
    if not halves:
        return 8 * j + c
    lane, q = c // 4, c % 4
    return HALVES_BLOCK * (j // 16) + 64 * (q % 2) + 4 * (j % 16) + 2 * lane + q // 2


def permute_columns(x: torch.Tensor, scale: float = 1.0, halves: bool = False) -> torch.Tensor:
    """x [R, K] -> xp [R, 8, K/8] fp32 with xp[r, c, j] = x[r, col(c, j)] * scale (`column_map`;
    one launch; `scale` a power of two: exact)."""
    rows, k = x.shape
    out = torch.empty(rows, 8, k // 8, dtype=torch.float32, device=x.device)
    if halves:  # col = 128b + 64h + 4m + 2 lane + t -> [c = 4 lane + 2t + h, j = 16b + m]
        src = x.view(rows, k // HALVES_BLOCK, 2, 16, 2, 2).permute(0, 4, 5, 2, 1, 3)
        torch.mul(src, scale, out=out.view(rows, 2, 2, 2, k // HALVES_BLOCK, 16))
    else:
        torch.mul(x.unflatten(1, (k // 8, 8)).transpose(1, 2), scale, out=out)
    return out


def unpermute_columns(xp: torch.Tensor, halves: bool = False) -> torch.Tensor:
    """Inverse of `permute_columns`: [R, 8, K/8] -> [R, K]."""
    rows, k = xp.shape[0], 8 * xp.shape[2]
    if halves:
        src = xp.view(rows, 2, 2, 2, k // HALVES_BLOCK, 16).permute(0, 4, 3, 5, 1, 2)
        return src.reshape(rows, k)
    return xp.transpose(1, 2).reshape(rows, -1)


def _words(w: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 bytes [E, rows, cols/2] int8 -> the same memory as int32 words [E, rows,
    cols/8] (each row's bytes in order: a row starts on a word when cols/2 is a multiple of 4)."""
    assert w.dtype == torch.int8 and w.stride(2) == 1 and w.shape[2] % 4 == 0, w.shape
    return w.view(torch.int32)


def gemv_gemms(x, sorted_ids, tile_e, w13, w2, scales, rows, topk, limit, cfg: dict,
               format: str = "mxfp4") -> None:  # fmt: skip
    """h = SwiGLU(W13_e x) and rows [T*K, D] = W2_e h over the expert-sorted pairs, MXFP4
    experts (kernels/moe.py layout: int8 [E, rows, cols/2], UE8M0 scales [E, rows, cols/32];
    `format` one of GEMV_FORMATS)."""
    num_pairs, dim = rows.shape
    inter = w13.shape[1] // 2
    assert format in GEMV_FORMATS, format
    halves = format != "mxfp4"
    block = HALVES_BLOCK if halves else 32
    assert dim % block == 0 and inter % block == 0, (dim, inter, format)
    cfg = dict(cfg)
    block_m, block_w = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_W")
    assert block_m in (1, 2), block_m
    block_n, block_n2 = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_N2")
    w13w, w2w = _words(w13), _words(w2)
    s13, s2 = (s.view(torch.uint8) for s in scales)
    post_scale = bool(cfg.pop("POST_SCALE", POST_SCALE_DEFAULT))
    assert not halves or block_w % 16 == 0, block_w  # whole 128-column blocks (their scales)
    xp = permute_columns(x, 2.0**64 if post_scale else 1.0, halves)
    hp = torch.empty(sorted_ids.numel(), 8, inter // 8, dtype=torch.float32, device=x.device)
    blocks = dict(BLOCK_M=block_m, BLOCK_W=block_w, POST_SCALE=post_scale, HALVES=halves, **cfg)
    _gemv13_kernel[(tile_e.numel(), triton.cdiv(inter, block_n))](
        xp, sorted_ids, tile_e, w13w, s13, hp,
        num_pairs, dim, inter,
        xp.stride(0), xp.stride(1), w13w.stride(0), w13w.stride(1), s13.stride(0), s13.stride(1),
        hp.stride(0), hp.stride(1), float(limit) if limit is not None else 0.0,
        TOPK=topk, HAS_LIMIT=limit is not None, BLOCK_N=block_n, **blocks,
    )  # fmt: skip
    _gemv2_kernel[(tile_e.numel(), triton.cdiv(dim, block_n2))](
        hp, sorted_ids, tile_e, w2w, s2, rows,
        num_pairs, dim, inter,
        hp.stride(0), hp.stride(1), w2w.stride(0), w2w.stride(1), s2.stride(0), s2.stride(1),
        rows.stride(0), BLOCK_N=block_n2, **blocks,
    )  # fmt: skip
