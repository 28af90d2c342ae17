"""mHC (docs/model.md#hyper-connections) against literal per-token transcriptions of the
equations."""

from __future__ import annotations

import torch

from dsv4.ops.hyper import hc_head, hc_post, hc_post_first, hc_pre, hc_pre_first, sinkhorn
from tests.model.conftest import tiny_model

M, D, ITERS, EPS, NORM_EPS = 4, 16, 20, 1e-6, 1e-6


def _params(gen, rows=(2 + M) * M):
    fn = torch.randn(rows, M * D, generator=gen) * 0.5
    base = torch.randn(rows, generator=gen)
    scale = 1 + torch.rand(3 if rows > M else 1, generator=gen)
    return fn, scale, base


def _literal_pre(x, fn, scale, base):
    """docs/model.md#hc_pre for one token x [M, D], written step by step."""
    xbar = x.reshape(-1)
    rho = 1 / torch.sqrt(xbar.square().mean() + NORM_EPS)
    m = rho * (fn @ xbar)
    pre = torch.sigmoid(scale[0] * m[:M] + base[:M]) + EPS
    post = 2 * torch.sigmoid(scale[1] * m[M : 2 * M] + base[M : 2 * M])
    c = torch.empty(M, M)
    for i in range(M):
        for j in range(M):
            c[i, j] = scale[2] * m[2 * M + i * M + j] + base[2 * M + i * M + j]
    c = torch.softmax(c, dim=1) + EPS
    c = c / (c.sum(dim=0, keepdim=True) + EPS)
    for _ in range(ITERS - 1):
        c = c / (c.sum(dim=1, keepdim=True) + EPS)
        c = c / (c.sum(dim=0, keepdim=True) + EPS)
    u = sum(pre[i] * x[i] for i in range(M))
    return u, post, c


def test_sinkhorn_is_doubly_stochastic():
    """Columns are exact (the last step normalises them); rows converge to 1e-3 within 20
    iterations for logits of order 1, the regime of the model (very peaked logits, e.g.
    std 5, converge slower: that is Sinkhorn, not the implementation)."""
    logits = torch.randn(4096, M, M, generator=torch.Generator().manual_seed(0))
    comb = sinkhorn(logits, ITERS, EPS)
    assert (comb >= 0).all()
    torch.testing.assert_close(comb.sum(-1), torch.ones(4096, M), atol=1e-3, rtol=0)
    torch.testing.assert_close(comb.sum(-2), torch.ones(4096, M), atol=1e-5, rtol=0)


def test_model_combs_are_doubly_stochastic():
    model = tiny_model(seed=6)
    block = model.layers[1]
    x = torch.randn(32, M, model.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    for fn, scale, base in (
        (block.hc_attn_fn, block.hc_attn_scale, block.hc_attn_base),
        (block.hc_ffn_fn, block.hc_ffn_scale, block.hc_ffn_base),
    ):
        _, _, comb = hc_pre(x, fn, scale, base, ITERS, EPS, NORM_EPS)
        torch.testing.assert_close(comb.sum(-1), torch.ones(32, M), atol=1e-3, rtol=0)
        torch.testing.assert_close(comb.sum(-2), torch.ones(32, M), atol=1e-3, rtol=0)


def test_hc_pre_and_post_match_the_equations():
    gen = torch.Generator().manual_seed(1)
    fn, scale, base = _params(gen)
    x = torch.randn(5, M, D, generator=gen)
    y = torch.randn(5, D, generator=gen)
    u, post, comb = hc_pre(x, fn, scale, base, ITERS, EPS, NORM_EPS)
    out = hc_post(y, x, post, comb)
    for t in range(5):
        u_t, post_t, c_t = _literal_pre(x[t], fn, scale, base)
        torch.testing.assert_close(u[t], u_t, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(post[t], post_t, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(comb[t], c_t, atol=1e-6, rtol=1e-5)
        for j in range(M):  # X'_j = post_j y + sum_i C[i, j] X_i
            want = post_t[j] * y[t] + sum(c_t[i, j] * x[t, i] for i in range(M))
            torch.testing.assert_close(out[t, j], want, atol=1e-5, rtol=1e-5)


def test_first_layer_path_equals_materialised_copies():
    gen = torch.Generator().manual_seed(2)
    fn, scale, base = _params(gen)
    e = torch.randn(2, 3, D, generator=gen)
    y = torch.randn(2, 3, D, generator=gen)
    copies = e.unsqueeze(-2).expand(2, 3, M, D)
    u, post, comb = hc_pre(copies, fn, scale, base, ITERS, EPS, NORM_EPS)
    u1, post1, comb1 = hc_pre_first(e, fn, scale, base, M, ITERS, EPS, NORM_EPS)
    torch.testing.assert_close(u1, u, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(post1, post, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(comb1, comb, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(
        hc_post_first(y, e, post1, comb1), hc_post(y, copies, post, comb), atol=1e-5, rtol=1e-5
    )


def test_hc_head_matches_the_equation():
    gen = torch.Generator().manual_seed(3)
    fn, scale, base = _params(gen, rows=M)
    x = torch.randn(4, M, D, generator=gen)
    h = hc_head(x, fn, scale, base, EPS, NORM_EPS)
    for t in range(4):
        xbar = x[t].reshape(-1)
        rho = 1 / torch.sqrt(xbar.square().mean() + NORM_EPS)
        a = torch.sigmoid(scale * rho * (fn @ xbar) + base) + EPS
        torch.testing.assert_close(h[t], (a.unsqueeze(-1) * x[t]).sum(0), atol=1e-5, rtol=1e-5)


def test_unfused_first_layer_gives_the_same_logits() -> None:
    """#48137: hc from the embedding directly equals repeating it into M streams first."""
    from dsv4.config.model import tiny_config
    from dsv4.model.tiny import random_model

    cfg = tiny_config().with_overrides(num_hidden_layers=1, compress_ratios=(0,))
    model = random_model(cfg.with_overrides(num_nextn_predict_layers=0), seed=2)
    ids = torch.randint(2, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    fused = model(ids).logits
    model.fuse_first_hc = False
    torch.testing.assert_close(model(ids).logits, fused, atol=1e-5, rtol=0)
