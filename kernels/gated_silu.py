"""The SwiGLU activation of a dense expert in one launch, bitwise the torch reference's.

    h = bf16(silu(min(gate, limit)) * clamp(up, -limit, limit))       gate, up [T, I] -> h [T, I]

exactly as `dsv4.ops.moe.gated_silu(gate, up, limit).to(gate.dtype)` (`Expert.forward`'s
activation; limit None = no clamp): fp32 math, silu(x) = x / (1 + exp(-x)), one fp32 multiply,
one round to the output dtype. In torch that is ~7 launches (two casts, two clamps, silu, the
multiply, the cast); the paged forward's shared expert runs this op instead (issue 25).

Bitwise, not merely close: every step is a correctly rounded IEEE operation except exp, so the
kernel computes exp the way the reference does on that device.
- GPU: ATen's CUDA silu is `x / (1 + expf(-x))` in fp32, built without fast math: libdevice's
  `__nv_expf` and an IEEE division. Here: libdevice's exp (the same `__nv_expf`) and
  `tl.math.div_rn` (not `tl.exp`, which is ex2.approx, nor `/`, which is approximate); the PTX
  holds div.rn.f32, add.f32 and mul.f32 without .ftz. Triton links libdevice with FTZ on, which
  touches only subnormal exp inputs (exp = 1 either way) and results (x > 87.3, where 1 + exp(-x)
  rounds to 1 either way). The clamps (selects: a NaN stays NaN, as in torch's clamp), the
  multiply and the round are exact operations, so the output bits are the reference's, given
  torch's expf and Triton's libdevice share CUDA's expf algorithm (the gpu test checks it).
- CPU (TRITON_INTERPRET=1, tests): the interpreter has no libdevice and numpy's exp differs from
  ATen's in ~2% of bf16 inputs by 1-3 ulp, so the kernel computes Sleef's `expf_u10` (ATen's
  `Vectorized<float>::exp` on AVX2 / AVX-512: Cody-Waite reduction, a degree-6 polynomial, in
  fp32 FMAs, which the interpreter rounds once), bitwise ATen's vectorised silu for every bf16
  input. ATen runs the last < 16 elements of each parallel chunk through `std::exp` (glibc)
  instead, which differs from Sleef for 122 of the 65280 non-NaN bf16 inputs by <= 2 ulp of the
  fp32 silu; after the multiply and the bf16 round that can flip an output bit only where the
  product sits within those ulps of a bf16 rounding boundary (rare; the tests' inputs hit none).
bf16 gate / up / h move as int16 bits, widened and rounded (to nearest even) by integer ops:
the interpreter's bf16 casts truncate and mangle subnormals; on the GPU the same ops give what
its converts give. A NaN output is stored as CUDA's canonical bf16 NaN (0x7FFF), as torch's
cast on the GPU stores it (on the CPU ATen's cast stores 0xFFFF or 0x7FC0, by position).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.language.extra import libdevice

from dsv4.ops.moe import gated_silu as _gated_silu_fp32
from kernels.jit_helpers import bf16_rne
from kernels.registry import register_op

# Under the interpreter (CPU tests) libdevice cannot run: Sleef's expf stands in (module doc).
# A module constant, not a launch argument, so the sm_90 compile check (which imports this
# module without TRITON_INTERPRET) compiles the libdevice path the GPU runs.
_LIBDEVICE_EXP = tl.constexpr(not knobs.runtime.interpret)


@triton.jit
def _sleef_expf(d):
    """Sleef's expf_u10 (ATen's AVX2 / AVX-512 exp), fp32 -> fp32, FMAs rounded once."""
    dc = tl.where(d != d, 0.0, tl.minimum(tl.maximum(d, -200.0), 200.0))  # q fits an int32
    q = dc * 1.4426950408889634  # x / ln 2
    q = (q + 12582912.0) - 12582912.0  # rint (|q| < 2^22): _mm256_cvtps_epi32's round-to-even
    s = tl.fma(q, -0.693145751953125, dc)  # ln 2, upper bits
    s = tl.fma(q, -1.428606765330187045e-06, s)  # ln 2, lower bits
    u = tl.fma(0.000198527617612853646278381, s, 0.00139304355252534151077271)
    u = tl.fma(u, s, 0.00833336077630519866943359)
    u = tl.fma(u, s, 0.0416664853692054748535156)
    u = tl.fma(u, s, 0.166666671633720397949219)
    u = tl.fma(u, s, 0.5)
    u = 1.0 + tl.fma(s * s, u, s)
    qi = q.to(tl.int32)  # u * 2^q in two steps (each factor a normal power of two)
    half = qi >> 1
    u = u * ((half + 127) << 23).to(tl.float32, bitcast=True)
    u = u * ((qi - half + 127) << 23).to(tl.float32, bitcast=True)
    u = tl.where(d < -104.0, 0.0, u)
    u = tl.where(d > 100.0, float("inf"), u)
    return tl.where(d != d, d, u)


@triton.jit
def _exp(x):
    # one return: Triton type-checks every return of a jit function, constexpr-dead or not
    if _LIBDEVICE_EXP:
        e = libdevice.exp(x)
    else:
        e = _sleef_expf(x)
    return e


@triton.jit
def _load_f32(ptrs, ok, BF16: tl.constexpr):
    """fp32 values at `ptrs`; BF16: the int16 bits widened by hand (exact, subnormals too)."""
    if BF16:
        x = (tl.load(ptrs, mask=ok, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    return x


@triton.jit
def _gated_silu_kernel(
    gate_ptr, up_ptr, out_ptr, INTER, stride_g, stride_u, stride_o, limit,
    HAS_LIMIT: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # program (row t, column block): BLOCK columns of one row of gate / up / out
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = col < INTER
    g = _load_f32(gate_ptr + row * stride_g + col, ok, BF16)
    u = _load_f32(up_ptr + row * stride_u + col, ok, BF16)
    if HAS_LIMIT:  # selects: a NaN stays NaN, as in torch's clamp
        g = tl.where(g > limit, limit, g)
        u = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
    h = tl.math.div_rn(g, 1.0 + _exp(-g)) * u  # [BLOCK] fp32
    out_ptrs = out_ptr + row * stride_o + col
    if BF16:  # round to nearest even in integers: what cvt.rn.bf16.f32 (torch's cast) does
        bits = bf16_rne(h).to(tl.int32, bitcast=True) >> 16
        bits = tl.where(h != h, 0x7FFF, bits)  # CUDA's canonical NaN (rounding could wrap one)
        tl.store(out_ptrs, bits.to(tl.int16), mask=ok)
    else:
        tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., I] -> [rows, I] with unit column stride (a view for the callers' contiguous rows)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def gated_silu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit), rounded to gate's dtype: one launch.
    gate, up [..., I] (same shape and dtype: bf16 as served, fp16 or fp32) -> [..., I]."""
    assert gate.shape == up.shape and gate.dtype == up.dtype, (gate.shape, up.shape, up.dtype)
    g, u = _rows(gate), _rows(up)
    out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    num_t, inter = g.shape
    bf16 = gate.dtype == torch.bfloat16
    # bf16 moves as int16 bits (module doc); the views share storage and strides
    g, u, o = (t.view(torch.int16) if bf16 else t for t in (g, u, out))
    if out.numel():
        block = min(1024, triton.next_power_of_2(inter))
        _gated_silu_kernel[(num_t, triton.cdiv(inter, block))](
            g, u, o, inter, g.stride(0), u.stride(0), o.stride(0),
            0.0 if limit is None else float(limit), HAS_LIMIT=limit is not None, BF16=bf16,
            BLOCK=block, num_warps=4 if block >= 512 else 1,
        )  # fmt: skip
    return out.view(gate.shape)


def gated_silu_ref(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    return _gated_silu_fp32(gate, up, limit).to(gate.dtype)


register_op("gated_silu", gated_silu, gated_silu_ref, family="gated_silu")
