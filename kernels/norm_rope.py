"""RMSNorm and rotary embedding in one launch (the per-layer glue of the paged forward).

    y = rms_norm(x, weight, eps)            fp32 statistics, weight in fp32, cast to x.dtype
    out = apply_rope(y, cos, sin, inverse)  the last 2·half channels rotated in interleaved
                                            pairs (even, odd); the first channels copied

exactly as `dsv4.model.layers.rms_norm` then `dsv4.model.rope.apply_rope`, including the cast
to x.dtype between the two (the reference rounds the norm's output before rotating it). Either
half can be off: `norm_rope(x, ..., rope=False)` is a plain RMSNorm, `rope(...)` a plain
(inverse) rotation. In torch each of them is 5-10 small launches (casts, square, mean, rsqrt,
muls; slices, unflatten, stack, cat); at decode batch sizes those launches, not their bytes,
were the glue time of a CUDA-graph step (docs/BENCHMARKS.md, decode attribution).

One program per row of D channels (rows = tokens × heads); a channel's rotation partner is
re-loaded (index c ^ 1, an L1 hit) instead of shuffled between lanes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops.norm import rms_norm
from dsv4.ops.rope import apply_rope
from kernels.registry import register_op


@triton.jit
def _normed(x_ptr, w_ptr, c, ok, rstd, NORM: tl.constexpr, HAS_W: tl.constexpr):
    # channel c of the row after the norm, rounded to the output dtype as the reference does
    v = tl.load(x_ptr + c, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        v = v * rstd
        if HAS_W:
            v = v * tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
        v = v.to(x_ptr.dtype.element_ty).to(tl.float32)
    return v


@triton.jit
def _norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr,
    D, heads, stride_xr, stride_or, stride_ct, eps,
    HALF: tl.constexpr, NORM: tl.constexpr, HAS_W: tl.constexpr, ROPE: tl.constexpr,
    INVERSE: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_D)
    ok = c < D
    x_row = x_ptr + row * stride_xr
    rstd = 0.0
    if NORM:
        xf = tl.load(x_row + c, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    y = _normed(x_row, w_ptr, c, ok, rstd, NORM, HAS_W)
    if ROPE:
        j = c - (D - 2 * HALF)  # index inside the rotated tail; < 0 on the copied channels
        rot = ok & (j >= 0)
        partner = _normed(x_row, w_ptr, c ^ 1, rot, rstd, NORM, HAS_W)  # D - 2·HALF is even
        t = row // heads
        pair = tl.maximum(j, 0) // 2
        cos = tl.load(cos_ptr + t * stride_ct + pair, mask=rot, other=1.0)
        sin = tl.load(sin_ptr + t * stride_ct + pair, mask=rot, other=0.0)
        if INVERSE:
            sin = -sin
        is_even = (j % 2) == 0
        # (even, odd) -> (even·cos - odd·sin, even·sin + odd·cos)
        rotated = tl.where(is_even, y * cos - partner * sin, partner * sin + y * cos)
        y = tl.where(rot, rotated, y)
    tl.store(out_ptr + row * stride_or + c, y.to(out_ptr.dtype.element_ty), mask=ok)


def _launch(x, weight, eps, cos, sin, *, norm: bool, rope: bool, inverse: bool) -> torch.Tensor:
    """x [T, D] or [T, H, D] (last dim contiguous) -> out of x's shape and dtype."""
    assert x.stride(-1) == 1 and x.dim() in (2, 3), (x.shape, x.stride())
    num_t, dim = x.shape[0], x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    rows = x.reshape(num_t * heads, dim)  # a view for contiguous rows (the callers' case)
    out = torch.empty(num_t * heads, dim, dtype=x.dtype, device=x.device)
    half = cos.shape[-1] if rope else 1
    if rope:
        assert cos.shape == sin.shape and cos.shape[0] == num_t and cos.stride(-1) == 1
        assert sin.stride() == cos.stride() and (dim - 2 * half) % 2 == 0 and 2 * half <= dim
    if weight is not None:
        assert weight.shape == (dim,) and weight.stride(0) == 1
    if rows.shape[0]:
        dummy = out  # never read: HAS_W / ROPE are off
        _norm_rope_kernel[(rows.shape[0],)](
            rows, weight if weight is not None else dummy, cos if rope else dummy,
            sin if rope else dummy, out, dim, heads, rows.stride(0), out.stride(0),
            cos.stride(0) if rope else 0, float(eps), HALF=half, NORM=norm,
            HAS_W=weight is not None, ROPE=rope, INVERSE=inverse,
            BLOCK_D=triton.next_power_of_2(dim), num_warps=4 if dim >= 1024 else 1,
        )  # fmt: skip
    return out.view(x.shape)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
              cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """rms_norm(x, weight, eps), then (with cos/sin [T, half] fp32) apply_rope: one launch."""
    return _launch(x, weight, eps, cos, sin, norm=True, rope=cos is not None, inverse=False)


def norm_rope_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                  cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    y = rms_norm(x, weight, eps)
    return y if cos is None else apply_rope(y, cos, sin)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              inverse: bool = False) -> torch.Tensor:  # fmt: skip
    """apply_rope(x, cos, sin, inverse) in one launch: x [T, D] or [T, H, D]."""
    return _launch(x, None, 0.0, cos, sin, norm=False, rope=True, inverse=inverse)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  inverse: bool = False) -> torch.Tensor:  # fmt: skip
    return apply_rope(x, cos, sin, inverse=inverse)


register_op("norm_rope", norm_rope, norm_rope_ref, family="norm_rope")
register_op("rope", rope, rope_ref, family="norm_rope")
