"""Manifold-constrained hyper-connections (mHC), docs/model.md#hyper-connections.

The residual is M = hc_mult streams X [..., M, D]. Around every sublayer:
    u, post, comb = hc_pre(X)            # collapse M streams into the sublayer input
    X' = hc_post(sublayer(u), X, post, comb)
All mixing math is fp32. The first block receives M identical copies of the embedding; the
`*_first` variants take the embedding e [..., D] and never materialise the copies.
"""

from __future__ import annotations

import torch


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., M, M] logits -> doubly stochastic comb, in the exact order of docs/model.md#hc_pre.

    Row softmax, +eps, one column normalisation, then (iters - 1) x (row, column).
    """
    comb = logits.softmax(dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _split_mixes(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, m: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [..., (2+M)M] -> pre [..., M], post [..., M], comb [..., M, M] (all fp32)."""
    scale, base = scale.float(), base.float()
    pre = torch.sigmoid(mixes[..., :m] * scale[0] + base[:m]) + eps
    post = 2 * torch.sigmoid(mixes[..., m : 2 * m] * scale[1] + base[m : 2 * m])
    comb_logits = mixes[..., 2 * m :] * scale[2] + base[2 * m :]
    comb = sinkhorn(comb_logits.unflatten(-1, (m, m)), iters, eps)
    return pre, post, comb


def hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., M, D] -> (u [..., D] in x.dtype, post [..., M], comb [..., M, M])."""
    m = x.shape[-2]
    flat = x.flatten(-2).float()  # [..., M*D], stream-major
    rho = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)  # [..., 1]
    mixes = torch.nn.functional.linear(flat, fn.float()) * rho  # [..., (2+M)M]
    pre, post, comb = _split_mixes(mixes, scale, base, m, iters, eps)
    u = (pre.unsqueeze(-1) * x.float()).sum(dim=-2)  # [..., D]
    return u.to(x.dtype), post, comb


def hc_pre_first(
    e: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    m: int,
    iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_pre of M copies of e [..., D] without building them (docs/model.md#first-block).

    mean(x^2) = mean(e^2); F x = (sum_k F[:, kD:(k+1)D]) e; u = (sum_i pre_i) e.
    """
    d = e.shape[-1]
    ef = e.float()
    rho = torch.rsqrt(ef.square().mean(-1, keepdim=True) + norm_eps)
    fn_summed = fn.float().unflatten(-1, (m, d)).sum(dim=-2)  # [(2+M)M, D]
    mixes = torch.nn.functional.linear(ef, fn_summed) * rho
    pre, post, comb = _split_mixes(mixes, scale, base, m, iters, eps)
    u = pre.sum(dim=-1, keepdim=True) * ef
    return u.to(e.dtype), post, comb


def hc_post(
    y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """X'_j = post_j * y + sum_i comb[i, j] * X_i   (y [..., D], x [..., M, D])."""
    mixed = torch.einsum("...ij,...id->...jd", comb, x.float())  # [..., M, D]
    return (post.unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(x.dtype)


def hc_post_first(
    y: torch.Tensor, e: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """hc_post when the input streams are M copies of e: sum_i comb[i, j] X_i = colsum_j e."""
    colsum = comb.sum(dim=-2)  # [..., M]
    out = post.unsqueeze(-1) * y.float().unsqueeze(-2) + colsum.unsqueeze(-1) * e.float().unsqueeze(
        -2
    )
    return out.to(e.dtype)


def hc_head(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """Final collapse: h = sum_m a_m X_m, a = sigmoid(s * rho * F x + b) + eps."""
    flat = x.flatten(-2).float()
    rho = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixes = torch.nn.functional.linear(flat, fn.float()) * rho  # [..., M]
    a = torch.sigmoid(mixes * scale.float() + base.float()) + eps
    return (a.unsqueeze(-1) * x.float()).sum(dim=-2).to(x.dtype)
