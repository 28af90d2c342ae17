"""route / hash_route (kernels/routing.py) against route_ref / hash_route_ref.

Selection is compared as sets per row (order is free), weights after aligning by expert id.
Inputs are continuous random values, so ties in the selection values do not occur.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close

from kernels.routing import hash_route, hash_route_ref, route, route_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=1)
    return weights.gather(1, order), ids.gather(1, order)


def _check_route(logits, bias, k, scale, renormalize=True, fast=None):
    w, ids = route(logits, bias, k, scale, renormalize, fast=fast)
    w_ref, ids_ref = route_ref(logits, bias, k, scale, renormalize)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and w.shape == (len(logits), k)
    w, ids = _by_id(w, ids)
    w_ref, ids_ref = _by_id(w_ref, ids_ref)
    assert torch.equal(ids, ids_ref)
    assert_close(w, w_ref, "route_weights")


@pytest.mark.parametrize("num_tokens", [0, 1, 3, 17])
@pytest.mark.parametrize(("num_experts", "k"), [(8, 2), (16, 6), (12, 1), (7, 7)])
def test_route_matches_ref(num_tokens, num_experts, k):
    g = torch.Generator().manual_seed(num_tokens * 100 + num_experts)
    logits = torch.randn(num_tokens, num_experts, generator=g).to(DEVICE)
    bias = (torch.rand(num_experts, generator=g) * 0.5).to(DEVICE)
    _check_route(logits, bias, k, 1.5)


@pytest.mark.parametrize(("num_experts", "num_tokens"), [(256, 1), (256, 5), (384, 3)])
def test_route_deepseek_v4_fast_path(num_experts, num_tokens):
    g = torch.Generator().manual_seed(num_experts + num_tokens)
    logits = (torch.randn(num_tokens, num_experts, generator=g) * 3).to(DEVICE)
    bias = (8.0 + torch.rand(num_experts, generator=g) * 0.1).to(DEVICE)  # Flash: ~8.08
    _check_route(logits, bias, 6, 2.5)


@pytest.mark.parametrize("fast", [True, False])
def test_route_both_paths_any_shape(fast):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(17, 16, generator=g).to(DEVICE)
    bias = torch.randn(16, generator=g).to(DEVICE) * 0.1
    _check_route(logits, bias, 6, 1.0, fast=fast)
    _check_route(logits[:, :12].contiguous(), bias[:12], 3, 1.0, renormalize=False, fast=fast)


def test_route_bias_selects_but_does_not_weigh():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], device=DEVICE)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0], device=DEVICE)  # forces expert 3 in
    w, ids = route(logits, bias, 2, 2.0)
    s = F.softplus(logits[0]).sqrt()
    expect = torch.stack([s[3], s[0]]) / (s[3] + s[0]) * 2.0
    w, ids = _by_id(w, ids)
    assert ids.tolist() == [[0, 3]]
    torch.testing.assert_close(w[0], expect[[1, 0]])


def test_route_extreme_logits():
    logits = torch.tensor([[-40.0, 30.0, -3.0, 25.0, 0.5, -100.0, 19.9, 20.1]], device=DEVICE)
    _check_route(logits, torch.zeros(8, device=DEVICE), 4, 1.5)


@pytest.mark.parametrize("num_tokens", [0, 1, 17])
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_hash_route_matches_ref(num_tokens, table_dtype):
    g = torch.Generator().manual_seed(num_tokens)
    num_experts, k, vocab = 12, 3, 50
    tid2eid = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(vocab)])
    tid2eid = tid2eid.to(table_dtype).to(DEVICE)
    token_ids = torch.randint(0, vocab, (num_tokens,), generator=g).to(DEVICE)
    logits = torch.randn(num_tokens, num_experts, generator=g).to(DEVICE)
    w, ids = hash_route(logits, token_ids, tid2eid, 1.5)
    w_ref, ids_ref = hash_route_ref(logits, token_ids, tid2eid, 1.5)
    assert ids.dtype == torch.int32 and torch.equal(ids, ids_ref)
    assert_close(w, w_ref, "route_weights")
    if num_tokens:
        torch.testing.assert_close(w.sum(1), torch.full_like(w[:, 0], 1.5))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 512, 8192])
@pytest.mark.parametrize(("num_experts", "scale"), [(256, 1.5), (384, 2.5)])
def test_route_production_shapes_gpu(num_tokens, num_experts, scale):
    g = torch.Generator().manual_seed(num_tokens)
    logits = (torch.randn(num_tokens, num_experts, generator=g) * 2).cuda()
    bias = (8.0 + torch.rand(num_experts, generator=g) * 0.2).cuda()
    _check_route(logits, bias, 6, scale)
    tid2eid = torch.randint(0, num_experts, (129280, 6), generator=g, dtype=torch.int32).cuda()
    token_ids = torch.randint(0, 129280, (num_tokens,), generator=g).cuda()
    w, ids = hash_route(logits, token_ids, tid2eid, scale)
    w_ref, ids_ref = hash_route_ref(logits, token_ids, tid2eid, scale)
    assert torch.equal(ids, ids_ref)
    assert_close(w, w_ref, "route_weights")
