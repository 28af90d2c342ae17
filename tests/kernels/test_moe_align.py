"""moe_align (kernels/moe_align.py: one Triton launch up to MAX_PAIRS pairs, three in chunks
above) against moe_align_ref (the torch ops): bit-identical sorted_ids and tile_e, on CPU under
the interpreter and at the decode and prefill shapes on GPU (also replayed from a CUDA graph)."""

from __future__ import annotations

import sys

import pytest
import torch

from kernels.moe_align import CHUNK, MAX_PAIRS, MAX_PAIRS_CHUNKED, moe_align, moe_align_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _random_ids(num_tokens, topk, num_experts, seed, dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, num_experts, (num_tokens, topk), generator=g).to(DEVICE, dtype)


def _distinct_per_token(num_tokens, topk, num_experts, seed):
    """Production routing: top-k distinct experts per token."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    return scores.argsort(1)[:, :topk].to(DEVICE, torch.int32)


def _assert_same(ids, num_experts, block_m):
    sorted_ids, tile_e = moe_align(ids, num_experts, block_m)
    ref_ids, ref_tile_e = moe_align_ref(ids, num_experts, block_m)
    assert sorted_ids.dtype == tile_e.dtype == torch.int32
    assert torch.equal(sorted_ids, ref_ids), (ids.shape, num_experts, block_m)
    assert torch.equal(tile_e, ref_tile_e), (ids.shape, num_experts, block_m)


# (num_tokens, topk): n = 1, odd, not a power of two, a decode batch of 64, the limit; each
# with E = 5, 256, 257 and block_m cycling through 16, 32, 64 (each E and size sees each one)
SHAPES = [(1, 1), (7, 3), (10, 6), (64, 6), (MAX_PAIRS // 8, 8)]
CASES = [
    (shape, num_experts, (16, 32, 64)[(i + j) % 3])
    for i, shape in enumerate(SHAPES)
    for j, num_experts in enumerate((5, 256, 257))
]


CASE_IDS = [f"{t}x{k}-E{e}-bm{b}" for (t, k), e, b in CASES]


@pytest.mark.parametrize("shape,num_experts,block_m", CASES, ids=CASE_IDS)
def test_moe_align_matches_ref(shape, num_experts, block_m):
    ids = _random_ids(*shape, num_experts, seed=shape[0] + num_experts)
    _assert_same(ids, num_experts, block_m)


def test_moe_align_one_expert_and_all_distinct():
    limit = (MAX_PAIRS // 8, 8)
    # every pair to one expert: one long run, the first (block_m 1: no padding) or the last
    _assert_same(torch.zeros(limit, dtype=torch.int32, device=DEVICE), 257, 1)
    _assert_same(torch.full(limit, 256, dtype=torch.int32, device=DEVICE), 257, 16)
    for num_experts, block_m in ((256, 16), (257, 1)):  # every pair its own expert
        perm = torch.randperm(num_experts, generator=torch.Generator().manual_seed(num_experts))
        _assert_same(perm.reshape(1, -1).to(DEVICE), num_experts, block_m)


def test_moe_align_int64_ids_and_edges():
    _assert_same(_random_ids(5, 6, 256, seed=1, dtype=torch.int64), 256, 16)
    _assert_same(_random_ids(0, 6, 256, seed=2), 256, 16)  # no pairs: empty outputs (ref path)
    _assert_same(_random_ids(MAX_PAIRS // 8 + 1, 8, 257, seed=3), 257, 64)  # just over: chunks


# the chunked path: just over the one-program limit, a V4-Flash prefill of 1024 tokens (3 whole
# chunks), ragged tails, few experts (long runs across chunks), block_m 1 (no padding), E = 512
CHUNKED = [((342, 6), 256, 16), ((1024, 6), 256, 64), ((700, 3), 5, 1), ((600, 7), 257, 32),
           ((2048, 6), 512, 128), ((1000, 6), 256, 16)]  # fmt: skip


@pytest.mark.parametrize("shape,num_experts,block_m", CHUNKED,
                         ids=[f"{t}x{k}-E{e}-bm{b}" for (t, k), e, b in CHUNKED])  # fmt: skip
def test_moe_align_chunked_matches_ref(shape, num_experts, block_m):
    assert shape[0] * shape[1] > MAX_PAIRS
    ids = _random_ids(*shape, num_experts, seed=shape[0] * num_experts)
    _assert_same(ids, num_experts, block_m)


def test_moe_align_chunked_runs_across_chunks_and_int64():
    n_tok = 2 * CHUNK // 6 + 5  # three chunks, the last one ragged
    # one expert: its run spans every chunk (each chunk's base must follow the one before)
    _assert_same(torch.full((n_tok, 6), 3, dtype=torch.int32, device=DEVICE), 256, 16)
    # production routing (distinct experts a token), int64 ids
    _assert_same(_distinct_per_token(n_tok, 6, 256, seed=7).long(), 256, 32)


def test_moe_align_launches_within_the_limits(monkeypatch):
    """Within the limits a kernel path answers (the reference is never called): one program to
    MAX_PAIRS, chunks above; past MAX_PAIRS_CHUNKED pairs or MAX_EXPERTS the reference does."""
    calls = []
    module = sys.modules["kernels.moe_align"]  # `kernels.moe_align` the attribute is the op
    monkeypatch.setattr(module, "moe_align_ref", lambda *a: calls.append(a) or moe_align_ref(*a))
    moe_align(_random_ids(MAX_PAIRS // 8, 8, 512, seed=4), 512, 16)
    moe_align(_random_ids(MAX_PAIRS // 8 + 1, 8, 512, seed=5), 512, 16)
    assert calls == []
    moe_align(_random_ids(4, 6, 513, seed=6), 513, 16)
    assert len(calls) == 1
    moe_align(torch.zeros(MAX_PAIRS_CHUNKED + 1, 1, dtype=torch.int32, device=DEVICE), 256, 16)
    assert len(calls) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [512, 1024, 8192, 16384])
def test_moe_align_prefill_shapes_gpu(num_tokens):
    """Prefill steps of V4-Flash (K = 6 of 256) take the chunked path; also from a graph."""
    ids = _distinct_per_token(num_tokens, 6, 256, seed=num_tokens)
    for block_m in (16, 64, 128):
        _assert_same(ids, 256, block_m)
    static_ids = ids.clone()
    moe_align(static_ids, 256, 64)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_align(static_ids, 256, 64)
    static_ids.copy_(_distinct_per_token(num_tokens, 6, 256, seed=num_tokens + 1))
    graph.replay()
    ref = moe_align_ref(static_ids, 256, 64)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


@pytest.mark.gpu
@pytest.mark.parametrize("num_experts", [256, 257])  # 257: the shared expert fused as slot E
@pytest.mark.parametrize("num_tokens", [1, 16, 64])
def test_moe_align_production_shapes_gpu(num_tokens, num_experts):
    """Decode batches (K = 6) on CUDA, direct and replayed from a CUDA graph (no host sync)."""
    ids = _distinct_per_token(num_tokens, 6, num_experts, seed=num_tokens)
    for block_m in (16, 32, 64):
        _assert_same(ids, num_experts, block_m)
    static_ids = ids.clone()
    moe_align(static_ids, num_experts, 16)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_align(static_ids, num_experts, 16)
    static_ids.copy_(_distinct_per_token(num_tokens, 6, num_experts, seed=num_tokens + 1))
    graph.replay()
    ref = moe_align_ref(static_ids, num_experts, 16)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
