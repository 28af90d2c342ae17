"""hc_pre / hc_pre_first_layer / hc_head / hc_post (kernels/mhc.py) against their references,
plus the properties docs/model.md#hyper-connections asks for (doubly-stochastic comb, Sinkhorn
order)."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close

from kernels.mhc import (
    _mix_config,
    _sinkhorn_ref,
    hc_head,
    hc_head_ref,
    hc_post,
    hc_post_ref,
    hc_pre,
    hc_pre_first_layer,
    hc_pre_first_layer_ref,
    hc_pre_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
M, ITERS, EPS, RMS_EPS = 4, 20, 1e-6, 1e-6


def _params(hidden, seed, n_mix=(2 + M) * M):
    g = torch.Generator().manual_seed(seed)
    fn = (torch.randn(n_mix, M * hidden, generator=g) / (M * hidden) ** 0.5).to(DEVICE)
    scale = torch.tensor([0.8, 1.2, 2.0][: 3 if n_mix > M else 1], device=DEVICE)
    base = (torch.randn(n_mix, generator=g) * 0.5).to(DEVICE)
    return fn, scale, base


def _x(num_tokens, hidden, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, M, hidden, generator=g).to(dtype).to(DEVICE)


def _check_pre(got, ref):
    assert_close(got[0], ref[0], "activation")
    assert_close(got[1], ref[1], "hc_mix")
    assert_close(got[2], ref[2], "hc_mix")


@pytest.mark.parametrize("num_tokens", [0, 1, 3, 17])
@pytest.mark.parametrize("hidden", [24, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_pre_matches_ref(num_tokens, hidden, dtype):
    x = _x(num_tokens, hidden, dtype, num_tokens)
    fn, scale, base = _params(hidden, hidden)
    ref = hc_pre_ref(x, fn, scale, base, ITERS, EPS, RMS_EPS)
    _check_pre(hc_pre(x, fn, scale, base, ITERS, EPS, RMS_EPS), ref)


@pytest.mark.parametrize("block_k", [16, 32])
def test_hc_pre_split_over_hidden(block_k):
    """Few tokens: the mixing GEMV is split along D over programs, then a finish kernel."""
    x = _x(5, 100, torch.bfloat16, 1)
    fn, scale, base = _params(100, 2)
    ref = hc_pre_ref(x, fn, scale, base, ITERS, EPS, RMS_EPS)
    _check_pre(hc_pre(x, fn, scale, base, ITERS, EPS, RMS_EPS, block_k=block_k), ref)
    h_fn, h_scale, h_base = _params(100, 3, n_mix=M)
    h = hc_head(x, h_fn, h_scale, h_base, EPS, RMS_EPS, block_k=block_k)
    assert_close(h, hc_head_ref(x, h_fn, h_scale, h_base, EPS, RMS_EPS), "activation")


@pytest.mark.parametrize("num_tokens", [1, 3, 17])
@pytest.mark.parametrize("use_dot", [False, True], ids=["fma", "dot"])
@pytest.mark.parametrize("block_k", [None, 16], ids=["one-split", "splits"])
def test_hc_mix_both_gemv_paths(num_tokens, use_dot, block_k):
    """FMA GEMV (the GPU's choice below 16 tokens) and tl.dot GEMV (from 16 on), each forced at
    odd token counts, with one split (finish inside the GEMV program) and with 3 splits."""
    kw = dict(block_k=block_k, use_dot=use_dot)
    x = _x(num_tokens, 40, torch.bfloat16, 30 + num_tokens)
    fn, scale, base = _params(40, 31)
    ref = hc_pre_ref(x, fn, scale, base, ITERS, EPS, RMS_EPS)
    _check_pre(hc_pre(x, fn, scale, base, ITERS, EPS, RMS_EPS, **kw), ref)
    e = x[:, 0].contiguous()
    ref = hc_pre_first_layer_ref(e, fn, scale, base, ITERS, EPS, RMS_EPS)
    for f in (fn, fn.view(-1, M, 40).sum(1)):  # unfolded, folded over the streams
        _check_pre(hc_pre_first_layer(e, f, scale, base, ITERS, EPS, RMS_EPS, **kw), ref)
    h_fn, h_scale, h_base = _params(40, 32, n_mix=M)
    h = hc_head(x.float(), h_fn, h_scale, h_base, EPS, RMS_EPS, **kw)
    assert_close(h, hc_head_ref(x.float(), h_fn, h_scale, h_base, EPS, RMS_EPS), "activation")


def test_mix_config_decode_sizes():
    """The launch configuration depends on sizes only (CPU tests run the GPU's), D = 4096."""
    c1, c16, c64, c512 = (_mix_config(t, 4096, (2 + M) * M) for t in (1, 16, 64, 512))
    assert not c1["use_dot"] and c1["block_t"] == 1 and c1["num_splits"] == 64
    assert c1["d_per_split"] == c1["block_k"]  # one chunk, one memory round trip per program
    assert c16["use_dot"] and c64["use_dot"] and c64["num_splits"] == 64
    assert (c1["fin_t"], c1["fin_warps"]) == (c64["fin_t"], c64["fin_warps"]) == (1, 1)
    assert (c512["fin_t"], c512["fin_warps"], c512["num_splits"]) == (16, 4, 8)


def test_hc_pre_decode_config_full_width():
    """T = 1 at D = 4096: exactly the GPU's decode launch (64 GEMV splits, 16 finish programs)."""
    x = _x(1, 4096, torch.bfloat16, 33)
    fn, scale, base = _params(4096, 34)
    ref = hc_pre_ref(x, fn, scale, base, ITERS, EPS, RMS_EPS)
    _check_pre(hc_pre(x, fn, scale, base, ITERS, EPS, RMS_EPS), ref)


def test_hc_pre_non_contiguous_streams():
    x_big = _x(3, 48, torch.float32, 4)
    x = x_big[:, :, :40]  # row stride 4·48, stream stride 48
    fn, scale, base = _params(40, 5)
    ref = hc_pre_ref(x, fn, scale, base, ITERS, EPS, RMS_EPS)
    _check_pre(hc_pre(x, fn, scale, base, ITERS, EPS, RMS_EPS), ref)


@pytest.mark.parametrize("num_tokens", [0, 1, 17])
@pytest.mark.parametrize("folded", [False, True])
def test_hc_pre_first_layer_equals_repeated(num_tokens, folded):
    e = _x(num_tokens, 40, torch.bfloat16, 6)[:, 0].contiguous()
    fn, scale, base = _params(40, 7)
    ref = hc_pre_ref(e.unsqueeze(1).repeat(1, M, 1), fn, scale, base, ITERS, EPS, RMS_EPS)
    _check_pre(hc_pre_first_layer_ref(e, fn, scale, base, ITERS, EPS, RMS_EPS), ref)
    fn_in = fn.view(-1, M, 40).sum(1) if folded else fn
    got = hc_pre_first_layer(e, fn_in, scale, base, ITERS, EPS, RMS_EPS, block_k=16)
    _check_pre(got, ref)


@pytest.mark.parametrize("num_tokens", [0, 1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_head_matches_ref(num_tokens, dtype):
    x = _x(num_tokens, 40, dtype, 8)
    fn, scale, base = _params(40, 9, n_mix=M)
    h = hc_head(x, fn, scale, base, EPS, RMS_EPS)
    assert_close(h, hc_head_ref(x, fn, scale, base, EPS, RMS_EPS), "activation")


@pytest.mark.parametrize("num_tokens", [0, 1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("first_layer", [False, True])
def test_hc_post_matches_ref(num_tokens, dtype, first_layer):
    x = _x(num_tokens, 40, dtype, 10)
    fn, scale, base = _params(40, 11)
    _, post, comb = hc_pre_ref(x, fn, scale, base, ITERS, EPS, RMS_EPS)
    y = _x(num_tokens, 40, dtype, 12)[:, 1]  # a strided [T, D] view
    if first_layer:
        x = x[:, 0].contiguous()
        dense = x.unsqueeze(1).repeat(1, M, 1)
        assert_close(hc_post_ref(y, x, post, comb), hc_post_ref(y, dense, post, comb), "activation")
    assert_close(hc_post(y, x, post, comb), hc_post_ref(y, x, post, comb), "activation")


def test_hc_post_formula():
    y = torch.tensor([[1.0, 2.0]], device=DEVICE)
    x = torch.arange(8.0, device=DEVICE).view(1, M, 2)
    post = torch.tensor([[1.0, 0.0, 2.0, 0.5]], device=DEVICE)
    comb = torch.arange(16.0, device=DEVICE).view(1, M, M) / 16
    expect = post[0, :, None] * y[0] + comb[0].t() @ x[0]  # X'_j = post_j y + Σ_i C[i,j] X_i
    torch.testing.assert_close(hc_post(y, x, post, comb)[0], expect)


def test_comb_is_doubly_stochastic():
    x = _x(17, 40, torch.float32, 13)
    fn, _, base = _params(40, 14)
    scale = torch.tensor([0.8, 1.2, 0.5], device=DEVICE)  # 20 iterations converge to ~1e-4
    _, post, comb = hc_pre(x, fn, scale, base, ITERS, EPS, RMS_EPS)
    ones = torch.ones(17, M, device=DEVICE)
    torch.testing.assert_close(comb.sum(1), ones, atol=1e-3, rtol=0)
    torch.testing.assert_close(comb.sum(2), ones, atol=1e-3, rtol=0)
    assert bool((post > 0).all() and (post < 2).all())


def test_sinkhorn_order():
    """docs/model.md#hc_pre Sinkhorn: softmax, +eps, column-normalise, then (iters-1)× (row,
    column)."""
    c0 = torch.randn(3, M, M, generator=torch.Generator().manual_seed(15)) * 3
    c = torch.softmax(c0, -1) + EPS
    c = c / (c.sum(-2, keepdim=True) + EPS)
    torch.testing.assert_close(_sinkhorn_ref(c0, 1, EPS), c)
    c = c / (c.sum(-1, keepdim=True) + EPS)
    c = c / (c.sum(-2, keepdim=True) + EPS)
    torch.testing.assert_close(_sinkhorn_ref(c0, 2, EPS), c)
    x = _x(3, 24, torch.float32, 16)
    fn, scale, base = _params(24, 17)
    for iters in (1, 2, 5):  # the kernel follows the same order for any iteration count
        ref = hc_pre_ref(x, fn, scale, base, iters, EPS, RMS_EPS)
        _check_pre(hc_pre(x, fn, scale, base, iters, EPS, RMS_EPS), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 3, 17, 64, 2048])
@pytest.mark.parametrize("hidden", [4096, 7168])
def test_mhc_production_shapes_gpu(num_tokens, hidden):
    x = _x(num_tokens, hidden, torch.bfloat16, 18)
    fn, scale, base = _params(hidden, 19)
    _check_pre(
        hc_pre(x, fn, scale, base, ITERS, EPS, RMS_EPS),
        hc_pre_ref(x, fn, scale, base, ITERS, EPS, RMS_EPS),
    )
    e = x[:, 0].contiguous()
    _check_pre(
        hc_pre_first_layer(e, fn, scale, base, ITERS, EPS, RMS_EPS),
        hc_pre_first_layer_ref(e, fn, scale, base, ITERS, EPS, RMS_EPS),
    )
    y = _x(num_tokens, hidden, torch.bfloat16, 20)[:, 0]
    _, post, comb = hc_pre_ref(x, fn, scale, base, ITERS, EPS, RMS_EPS)
    assert_close(hc_post(y, x, post, comb), hc_post_ref(y, x, post, comb), "activation")
    h_fn, h_scale, h_base = _params(hidden, 21, n_mix=M)
    h = hc_head(x, h_fn, h_scale, h_base, EPS, RMS_EPS)
    assert_close(h, hc_head_ref(x, h_fn, h_scale, h_base, EPS, RMS_EPS), "activation")
