"""Shared by the MoE kernel tests: random top-k routing, the output check, one step against
the reference."""

from __future__ import annotations

import torch

from kernels.moe import moe_experts, moe_experts_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def routing(num_tokens: int, num_experts: int, k: int, seed: int):
    """(expert ids [T, k] int32, distinct per token; weights [T, k] fp32 summing to 1.5)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(num_tokens, num_experts, generator=g).argsort(1)[:, :k].to(torch.int32)
    w = torch.rand(num_tokens, k, generator=g) + 0.1
    return ids.to(DEVICE), (w / w.sum(1, keepdim=True) * 1.5).to(DEVICE)


def assert_moe_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """y [T, D] fp32 against the reference: a bound relative to the largest output, and most
    elements far tighter (both sides round the same GEMM outputs to bf16; only summation order
    differs, so a rare element lands on the other side of a bf16 rounding)."""
    assert y.dtype == torch.float32 and y.shape == ref.shape
    scale = ref.abs().amax().item() if ref.numel() else 1.0
    torch.testing.assert_close(y, ref, atol=2e-2 * scale, rtol=2e-2)
    if ref.numel():
        close = ((y - ref).abs() <= 1e-3 * scale + 8e-3 * ref.abs()).float().mean().item()
        assert close >= 0.98, close


def check_step(weights, num_tokens, dim, k, fmt, limit, seed, tune=None) -> torch.Tensor:
    """moe_experts (with `tune`) on a random step of `num_tokens` over `weights` (w13, w2, s13,
    s2 in `fmt`) against moe_experts_ref; returns the kernel's output."""
    w13, w2, s13, s2 = weights
    g = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn(num_tokens, dim, generator=g) * 2).bfloat16().to(DEVICE)
    ids, w = routing(num_tokens, w13.shape[0], k, seed)
    y = moe_experts(x, ids, w, w13, w2, fmt, s13, s2, limit, tune=tune)
    ref = moe_experts_ref(x, ids, w, w13, w2, fmt, s13, s2, limit)
    assert y.shape == (num_tokens, dim)
    assert_moe_close(y, ref)
    return y


def every_code_weights(dim: int, inter: int):
    """One MXFP4 expert (w13, w2, s13, s2 as moe_experts takes them) whose bytes run through
    all 256 values (all 16 x 16 low / high e2m1 codes) under UE8M0 scales 2^-127 (subnormal
    weights), 2^-126, 2^-27, 1 and 2."""
    w13 = (torch.arange(2 * inter * dim // 2) % 256).to(torch.uint8).view(1, 2 * inter, dim // 2)
    w2 = (torch.arange(dim * inter // 2) * 7 % 256).to(torch.uint8).view(1, dim, inter // 2)
    s = torch.tensor([0, 1, 100, 127, 128], dtype=torch.uint8)
    s13 = s[torch.arange(2 * inter * dim // 32) % 5].view(1, 2 * inter, dim // 32)
    s2 = s[(torch.arange(dim * inter // 32) + 2) % 5].view(1, dim, inter // 32)
    codes = tuple(t.view(torch.int8).to(DEVICE) for t in (w13, w2))
    return codes + tuple(t.view(torch.float8_e8m0fnu).to(DEVICE) for t in (s13, s2))


def assert_graph_replay_equal(args: tuple, tune: dict) -> None:
    """moe_experts(*args, tune=tune) captured in a CUDA graph and replayed equals the eager call
    (no host sync, no allocation outside the graph's pool)."""
    eager = moe_experts(*args, tune=tune)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts(*args, tune=tune)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
