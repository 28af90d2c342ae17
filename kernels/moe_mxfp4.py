"""MXFP4 experts on the tensor cores without the per-element nibble decode: two candidates for
`kernels.moe_gemm`'s in-register kernel (FMT 2), each its own switch, the baseline unchanged.

Why: at 1024 tokens (24 pairs an expert, so one row tile an expert and each weight upcast once)
the FMT 2 kernel takes 6.1 ms against 3.2 ms for bf16 experts, while reading the 3.4 GB of MXFP4
experts takes 0.8 ms: it is bound by the decode of each e2m1 code (shifts, a select, an fp32
scale multiply built from a [BLOCK_K/32] -> [BLOCK_K/2] reshape, a cast) and by interleaving
the even / odd columns back into the MMA operand.

- "dot_scaled" (tune DOT_SCALED, the stored "mxfp4" layout, FMT 3): `tl.dot_scaled` with the
  weight as an "e2m1" operand and its UE8M0 scales as stored ([rows, cols/32]: exactly the
  layout the op takes). On sm_90 Triton's compiler upcasts the packed codes to bf16 itself,
  in the MMA operand's register layout (no shuffle), and runs the bf16 MMA.
- "halves" (format "mxfp4_halves64" / "mxfp4_halves128", FMT 4): the codes re-packed once at
  load (`repack_halves`, with its inverse in dsv4/ops/quant.py: the layout's torch reference) so that within each BLOCK_K-column block byte j holds column k0 + j
  (low nibble) and column k0 + BLOCK_K/2 + j (high nibble). The low nibbles of a K step are then
  one [BLOCK_K/2]-column tile and the high nibbles the next, each met by a contiguous slice of
  x in its own tl.dot: no interleave on either side. A code c = s e1 e0 m becomes fp32 by two
  shifts and one 3-input logic op, (c & 8) << 28 | (c & 7) << 22: sign, exponent field e1 e0
  and mantissa top bit where fp32 keeps them, the value e2m1 * 2^-126 (e = 0, the codes 0 and
  0.5, is the subnormal m/2 * 2^-126: no select). One fp32 multiply by 2^(s-1) (the UE8M0 byte
  s shifted into an exponent) gives e2m1 * 2^(s-127), exactly `mxfp4_dequantize`'s value, then
  one conversion to bf16 (exact: a 2-bit mantissa).
  On the GPU the codes go straight into bf16 bits instead, two at a time in one 32-bit
  register (`_E2M1_BF16_ASM`: sign to bit 15 of its 16-bit lane, e1 e0 m to bits 8..6: the same
  e2m1 * 2^-126, 0.5 a bf16 subnormal), then one packed bf16 multiply by 2^(s-1) (exact: a
  power of two; HMUL2 keeps subnormals). sm_90 compile (Triton 3.9, tools/moe_sass.py): 0.31
  warp instructions a weight byte against 0.48 through fp32, which spends an FMUL a code, an
  F2FP a pair and per-byte unpacking; on an H100 1.18x the fp32 form at 1024 tokens and
  1.10x at 8192 (served: kernels/moe.py HALVES_FP32_DEFAULT). 2^(s-1) is a finite bf16 only for s <= 128 (weights below
  16): the halves layouts hold no larger scale byte (`dsv4.ops.quant.halves_scales_fit`, checked
  where experts are re-packed; a layer with larger ones keeps the stored layout). The
  interpreter computes the same values through the fp32 bits.
Both compute on the dequantised values in bf16 with fp32 accumulation: outputs equal the
dequantise-then-GEMM reference up to fp32 summation order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4.ops.quant import HALVES_BLOCKS
from dsv4.ops.quant import halves_block as halves_block  # re-exported: the kernels' callers
from dsv4.ops.quant import repack_halves as repack_halves
from dsv4.ops.quant import unpack_halves as unpack_halves

# the layout and its names live with the formats' torch reference (dsv4/ops/quant.py)
HALVES_FORMATS = tuple(f"mxfp4_halves{b}" for b in HALVES_BLOCKS)


@triton.jit
def _e2m1_bits(code):
    """e2m1 codes (int32, bits 3..0 = s e1 e0 m) -> fp32 e2m1 * 2^-126 (module doc)."""
    return (((code & 8) << 28) | ((code & 7) << 22)).to(tl.float32, bitcast=True)


# 2 bytes [b1 b0] (a 16-bit operand) -> their low nibbles and their high nibbles as bf16 pairs
# (e2m1 * 2^-126, a 32-bit register each, b0's code in the low lane): the bytes spread to
# [0 b1 0 b0] by one PRMT, then per output the sign to bit 15 of each lane and e1 e0 m to bits
# 8..6: two shifts and two logic ops for two codes.
_E2M1_BF16_ASM = tl.constexpr("""
{
.reg .b32 w, z, t, u, v;
cvt.u32.u16 w, $2;
mov.b32 z, 0;
prmt.b32 t, w, z, 0x4140;
shl.b32 u, t, 12; shl.b32 v, t, 6;
and.b32 u, u, 0x80008000; and.b32 v, v, 0x01C001C0; or.b32 $0, u, v;
shl.b32 u, t, 8; shl.b32 v, t, 2;
and.b32 u, u, 0x80008000; and.b32 v, v, 0x01C001C0; or.b32 $1, u, v;
}
""")


@triton.jit
def _e2m1_bf16(packed):
    """uint8 bytes (two e2m1 codes each) -> (low nibbles, high nibbles) as bf16 e2m1 * 2^-126
    (GPU only: inline PTX, which the interpreter cannot run)."""
    return tl.inline_asm_elementwise(_E2M1_BF16_ASM, "=r,=r,h", [packed],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)  # fmt: skip


@triton.jit
def _scales(s_rows, g0, stride_sk, mk, BLOCK_N: tl.constexpr, HALF: tl.constexpr,
            SWAP_AB: tl.constexpr, AS_BF16: tl.constexpr = False):  # fmt: skip
    """The UE8M0 bytes of the HALF/32 scale groups from g0 as 2^(s-1) in fp32 (or bf16), broadcast to
    their columns: [BLOCK_N, HALF] (SWAP_AB) or [HALF, BLOCK_N]. s_rows: scale row pointers
    ([BLOCK_N, 1] or [1, BLOCK_N]); mk: the rows' mask."""
    if SWAP_AB:
        g = g0 + tl.arange(0, HALF // 32)[None, :]
    else:
        g = g0 + tl.arange(0, HALF // 32)[:, None]
    sb = tl.load(s_rows + g * stride_sk, mask=mk, other=127).to(tl.int32) & 0xFF
    if AS_BF16:  # the same 2^(s-1) as a bf16: exponent field s + 126 (s <= 128: the layout's)
        scale = ((sb + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        scale = ((sb + 126) << 23).to(tl.float32, bitcast=True)  # 2^126 * 2^(s - 127)
    # NOTE: one return at the end: compiled (not interpreted), code after a return in a
    # constexpr branch was still traced
    if HALF == 32:  # one group a half (BLOCK_K 64): the [BLOCK_N, 1] column broadcasts as it is
        out = scale
    elif SWAP_AB:
        out = tl.reshape(tl.broadcast_to(scale[:, :, None], [BLOCK_N, HALF // 32, 32]),
                         [BLOCK_N, HALF])  # fmt: skip
    else:
        out = tl.reshape(tl.broadcast_to(scale[:, None, :], [HALF // 32, 32, BLOCK_N]),
                         [HALF, BLOCK_N])  # fmt: skip
    return out


@triton.jit
def dot_mx(acc, a0, a1, w_rows, s_rows, wn_ok, k0, K, stride_sk, FMT: tl.constexpr,
           BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):  # fmt: skip
    """One K step of `kernels.moe_gemm._dot_w` for FMT 3 ("dot_scaled": a0 is the [BLOCK_M, BLOCK_K]
    x tile) and FMT 4 / 5 ("halves"; 5 upcasts through fp32 on the GPU too: a0 / a1 the x columns k0.. / k0 + BLOCK_K/2.., [BLOCK_M,
    BLOCK_K/2] each). w_rows / s_rows: the expert's weight rows / scale rows (pointers, [BLOCK_N,
    1] with SWAP_AB, else [1, BLOCK_N]); acc [BLOCK_M, BLOCK_N], SWAP_AB [BLOCK_N, BLOCK_M]."""
    if SWAP_AB:  # weight tiles [BLOCK_N, BLOCK_K/2]: the rows as stored
        kh = tl.arange(0, BLOCK_K // 2)[None, :]
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)[None, :]
    else:  # weight tiles [BLOCK_K/2, BLOCK_N]
        kh = tl.arange(0, BLOCK_K // 2)[:, None]
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)[:, None]
    # NOTE: masked per 32-column scale group (K is a multiple of 32), not per byte: per byte,
    # compiled for sm_90, the load split into 1-byte loads
    packed = tl.load(w_rows + (k0 // 2 + kh), mask=(k0 + 32 * (kh // 16) < K) & wn_ok, other=0)
    packed = packed.to(tl.int32) & 0xFF
    s_mask = (ks * 32 < K) & wn_ok
    if FMT == 3:
        sb = tl.load(s_rows + ks * stride_sk, mask=s_mask, other=127).to(tl.uint8)
        if SWAP_AB:  # [BLOCK_N, BLOCK_M] += W [BLOCK_N, K] @ a^T: the weight as the lhs
            acc = tl.dot_scaled(packed.to(tl.uint8), sb, "e2m1", tl.trans(a0), None, "bf16", acc)
        else:  # [BLOCK_M, BLOCK_N] += a @ W^T: rhs [K/2, BLOCK_N], scales [BLOCK_N, K/32]
            acc = tl.dot_scaled(a0, None, "bf16", packed.to(tl.uint8), tl.trans(sb), "e2m1", acc)
    else:
        # the low nibbles' columns k0 + [0, BLOCK_K/2), the high nibbles' the next BLOCK_K/2
        g_lo, g_hi = k0 // 32, k0 // 32 + BLOCK_K // 64
        if FMT == 4 and a0.dtype == tl.bfloat16:  # the GPU (the interpreter cannot run PTX)
            s_lo = _scales(s_rows, g_lo, stride_sk, wn_ok, BLOCK_N, BLOCK_K // 2, SWAP_AB, True)
            s_hi = _scales(s_rows, g_hi, stride_sk, wn_ok, BLOCK_N, BLOCK_K // 2, SWAP_AB, True)
            lo, hi = _e2m1_bf16(packed.to(tl.uint8))
            lo, hi = lo * s_lo, hi * s_hi
        else:  # the same values through fp32 bits (FMT 5: kernels/moe.py HALVES_FP32_DEFAULT)
            s_lo = _scales(s_rows, g_lo, stride_sk, wn_ok, BLOCK_N, BLOCK_K // 2, SWAP_AB)
            s_hi = _scales(s_rows, g_hi, stride_sk, wn_ok, BLOCK_N, BLOCK_K // 2, SWAP_AB)
            lo = (_e2m1_bits(packed) * s_lo).to(a0.dtype)
            hi = (_e2m1_bits(packed >> 4) * s_hi).to(a0.dtype)
        if SWAP_AB:
            acc = tl.dot(lo, tl.trans(a0), acc)
            acc = tl.dot(hi, tl.trans(a1), acc)
        else:
            acc = tl.dot(a0, lo, acc)
            acc = tl.dot(a1, hi, acc)
    return acc


def mx_config(num_pairs: int, num_experts: int, on_gpu: bool, halves: int | None) -> dict:
    """`moe_experts` tile config of the candidates (`halves`: the layout's K block, which is the
    K step; None for dot_scaled). The weight is the MMA's register operand (SWAP_AB: wgmma's A,
    its rows the M side), the expert's pairs the N side, so a row tile about as wide as an
    expert's pairs upcasts each weight about once: 16 at decode sizes, 32 at 1024 tokens (24
    pairs an expert), 64 at 8192 (192 pairs). Compiled for sm_90 as launched (tools/moe_sass.py)
    none of these tiles spills (at BLOCK_M 128 only dot_scaled with BLOCK_K 128, 8 B of stack);
    dot_scaled with BLOCK_K 64 runs 0.42-0.44 warp instructions a weight byte, FMT 2 0.97-0.98."""
    if not on_gpu:  # interpreter: few, large programs
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=halves or 64, GROUP_M=4, num_warps=4,
                    num_stages=1, SWAP_AB=True)  # fmt: skip
    per_expert = num_pairs / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    # halves, H100 2026-12-07 (benchmarks/results/moe-w4a8-h100.json): at 1024 tokens 64
    # weight rows a program and 4 warps took 2987 us against 4250 for 128 and 8; at 8192 a
    # 128-pair tile with the x tile as the MMA's A operand 11558 against 14654
    if halves and 16 < per_expert <= 48:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=halves, GROUP_M=4, num_warps=4,
                    num_stages=3, SWAP_AB=True)  # fmt: skip
    if halves and per_expert > 48:
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=halves, GROUP_M=4, num_warps=8,
                    num_stages=3, SWAP_AB=False)  # fmt: skip
    return dict(BLOCK_M=block_m, BLOCK_N=64 if block_m == 16 else 128, BLOCK_K=halves or 64,
                GROUP_M=4, num_warps=4 if block_m == 16 else 8, num_stages=3, SWAP_AB=True)  # fmt: skip
