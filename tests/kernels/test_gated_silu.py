"""gated_silu (one launch) bitwise against the torch reference `dsv4.ops.moe.gated_silu`.

Bitwise: the output bits equal the reference's, NaN positions included (a NaN's payload is not
compared: ATen's CPU bf16 cast stores 0xFFFF from its vector loop and 0x7FC0 from its scalar
tail). On CPU the kernel runs on the interpreter with Sleef's exp (kernels/gated_silu.py).
"""

from __future__ import annotations

import pytest
import torch

from kernels.backend import KernelBackendConfig, resolve
from kernels.gated_silu import gated_silu, gated_silu_ref
from kernels.registry import get_op
from tests.kernels.conftest import DEVICE

LIMITS = [None, 10.0, 7.3]  # off, V4's swiglu_limit, one fp32 cannot hold exactly
# (tokens, intermediate): empty, one element, odd widths, one full block + a partial one
SHAPES = [(0, 16), (1, 1), (3, 100), (17, 129), (5, 1500), (2, 2055)]
_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), "NaN positions differ"
    bits, ref_bits = got.view(_INT[got.dtype]), want.view(_INT[want.dtype])
    differ = (bits != ref_bits) & ~nan
    assert not differ.any(), (
        f"{int(differ.sum())} of {got.numel()} differ, first at {differ.nonzero()[0].tolist()}: "
        f"{got[differ][:4].tolist()} vs {want[differ][:4].tolist()}"
    )


def every_bf16() -> torch.Tensor:
    """All 65536 bf16 bit patterns (zeros, subnormals, normals, ±inf, NaNs), [64, 1024]."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    return bits.view(torch.bfloat16).view(64, 1024)  # few, wide programs: the interpreter


def _inputs(num_t: int, inter: int, dtype=torch.bfloat16, seed: int = 0):
    """gate, up [T, I]: normal values with a wide spread of magnitudes, signs and specials."""
    gen = torch.Generator().manual_seed(seed)
    mags = 10.0 ** torch.randint(-8, 4, (2, num_t, inter), generator=gen)  # 1e-8 .. 1e3
    gate, up = torch.randn(2, num_t, inter, generator=gen) * mags
    if gate.numel() > 8:  # infinities, NaN, zeros of either sign, the limits themselves
        specials = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 10.0,
                                 -10.0, 88.0])  # fmt: skip
        gate.view(-1)[:8], up.view(-1)[-8:] = specials, specials.flip(0)
    return gate.to(dtype).to(DEVICE), up.to(dtype).to(DEVICE)


@pytest.mark.parametrize("limit", LIMITS)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference_bitwise(shape, limit) -> None:
    gate, up = _inputs(*shape)
    assert_bitwise(gated_silu(gate, up, limit), gated_silu_ref(gate, up, limit))


@pytest.mark.parametrize("limit", LIMITS)
def test_every_bf16_gate_and_up(limit) -> None:
    """Every bf16 value as the gate (up = 1: the silu alone, rounded), then as the gate against
    shuffled ups (every value as up once): silu's exp is exact for the whole input range."""
    gate = every_bf16().to(DEVICE)
    ones = torch.ones_like(gate)
    assert_bitwise(gated_silu(gate, ones, limit), gated_silu_ref(gate, ones, limit))
    gen = torch.Generator().manual_seed(1)
    up = gate.view(-1)[torch.randperm(gate.numel(), generator=gen).to(DEVICE)].view_as(gate)
    assert_bitwise(gated_silu(gate, up, limit), gated_silu_ref(gate, up, limit))
    assert_bitwise(gated_silu(up, gate, limit), gated_silu_ref(up, gate, limit))


def test_strided_rows_and_leading_dims() -> None:
    """gate / up as the two halves of one [T, 2I] output (row stride 2I), and [B, S, I]."""
    gate, up = _inputs(7, 300, seed=2)
    both = torch.cat((gate, up), dim=1)
    g, u = both[:, :300], both[:, 300:]
    assert not g.is_contiguous()
    assert_bitwise(gated_silu(g, u, 10.0), gated_silu_ref(g, u, 10.0))
    g3, u3 = gate[:6].view(2, 3, 300), up[:6].view(2, 3, 300)
    got = gated_silu(g3, u3, None)
    assert got.shape == (2, 3, 300)
    assert_bitwise(got, gated_silu_ref(g3, u3, None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_dtypes(dtype) -> None:
    gate, up = _inputs(4, 333, dtype, seed=3)
    assert_bitwise(gated_silu(gate, up, 10.0), gated_silu_ref(gate, up, 10.0))


def test_resolves_to_triton_on_cuda_and_the_reference_on_cpu() -> None:
    cfg = KernelBackendConfig()
    assert resolve("gated_silu", cfg, "cuda") is get_op("gated_silu").triton_fn
    assert resolve("gated_silu", cfg, "cpu") is gated_silu_ref


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_t", [1, 64, 1024, 8192])
@pytest.mark.parametrize("limit", [None, 10.0])
def test_production_shapes_gpu(num_t, limit) -> None:
    """V4-Flash's shared expert: I = 2048 (one shared expert of the routed size), bf16."""
    gate, up = _inputs(num_t, 2048, seed=num_t)
    assert_bitwise(gated_silu(gate, up, limit), gated_silu_ref(gate, up, limit))
