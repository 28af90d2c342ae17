"""norm_rope / rope (one launch) against rms_norm then apply_rope (the model's torch)."""

from __future__ import annotations

import pytest
import torch

from kernels.norm_rope import norm_rope, norm_rope_ref, rope, rope_ref
from tests.kernels.conftest import DEVICE
from tests.kernels.tolerances import assert_close

# (tokens, heads or 0 for [T, D], D, rope channels): empty, one, odd, non-power-of-two D
SHAPES = [(0, 4, 64, 16), (1, 0, 64, 16), (3, 5, 96, 32), (17, 0, 512, 64), (2, 3, 512, 64),
          (4, 0, 40, 40)]  # fmt: skip


def _inputs(num_t, heads, dim, rope, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_t, heads, dim) if heads else (num_t, dim)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype).to(DEVICE)
    weight = (1 + 0.2 * torch.randn(dim, generator=gen)).to(DEVICE)
    angles = torch.rand(num_t, rope // 2, generator=gen) * 6.3
    return x, weight, angles.cos().to(DEVICE), angles.sin().to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_weight", [True, False])
def test_norm_then_rope_matches_reference(shape, dtype, with_weight) -> None:
    x, weight, cos, sin = _inputs(*shape, dtype)
    w = weight if with_weight else None
    assert_close(norm_rope(x, w, 1e-6, cos, sin), norm_rope_ref(x, w, 1e-6, cos, sin),
                 "activation")  # fmt: skip
    assert_close(norm_rope(x, w, 1e-6), norm_rope_ref(x, w, 1e-6), "activation")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_alone_matches_reference_and_inverts(shape, dtype, inverse) -> None:
    x, _, cos, sin = _inputs(*shape, dtype, seed=1)
    got = rope(x, cos, sin, inverse=inverse)
    assert_close(got, rope_ref(x, cos, sin, inverse=inverse), "activation")
    if dtype == torch.float32:  # rotating back gives the input (fp32 rounding only)
        assert_close(rope(got, cos, sin, inverse=not inverse), x, "activation")
    nope = shape[2] - shape[3]
    assert torch.equal(got[..., :nope], x[..., :nope])  # the unrotated channels are copied


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_t", [1, 64, 8192])
def test_production_shapes_gpu(num_t) -> None:
    """V4-Flash: hidden 4096 (attn/ffn norm), 64 heads x 512 with 64 rope channels (q, out),
    the 512-d K=V row; bf16 as served."""
    x, weight, _, _ = _inputs(num_t, 0, 4096, 64, torch.bfloat16)
    assert_close(norm_rope(x, weight, 1e-6), norm_rope_ref(x, weight, 1e-6), "activation")
    q, _, cos, sin = _inputs(num_t, 64, 512, 64, torch.bfloat16, seed=2)
    assert_close(norm_rope(q, None, 1e-6, cos, sin), norm_rope_ref(q, None, 1e-6, cos, sin),
                 "activation")  # fmt: skip
    assert_close(rope(q, cos, sin, inverse=True), rope_ref(q, cos, sin, inverse=True),
                 "activation")  # fmt: skip
    kv, w_kv, cos, sin = _inputs(num_t, 0, 512, 64, torch.bfloat16, seed=3)
    assert_close(norm_rope(kv, w_kv, 1e-6, cos, sin), norm_rope_ref(kv, w_kv, 1e-6, cos, sin),
                 "activation")  # fmt: skip
