"""A kernel Triton's compiler rejects but the CPU interpreter runs (tests/kernels/sm90_build.py):
its helper returns an fp32 in one constexpr branch and a uint8 after it."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_as(x_ptr, AS_FLOAT: tl.constexpr):
    if AS_FLOAT:
        return tl.load(x_ptr).to(tl.float32)
    return tl.load(x_ptr)


@triton.jit
def _mismatched_returns_kernel(x_ptr, o_ptr, AS_FLOAT: tl.constexpr):
    tl.store(o_ptr, _load_as(x_ptr, AS_FLOAT))
