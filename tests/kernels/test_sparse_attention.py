"""Sparse attention with sink (kernels/sparse_attention.py) against its reference, the reference
against the model's `sparse_attention`, and the attention benchmark's CPU dry run."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

import kernels.sparse_attention as sa
from dsv4.ops.attention import sparse_attention
from dsv4.ops.kv_codec import decode_rows, encode_rows
from tests.kernels.bench_dry_run import dry_run_records
from tests.kernels.conftest import DEVICE
from tests.kernels.tolerances import assert_close, tol

if DEVICE == "cpu":  # kernels imported before TRITON_INTERPRET was set: re-decorate ours
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(sa._attn_kernel, InterpretedFunction):
        sa = importlib.reload(sa)

ROOT = Path(__file__).resolve().parents[2]


def _entry_bytes(head_dim, rope):
    nope = head_dim - rope
    scale_blocks = -(-nope // 64)
    return nope + 2 * rope + -(-scale_blocks // 8) * 8


def _case(num_tokens, num_heads, head_dim, num_cand, *, seed, kv="fp8", q_dtype=torch.bfloat16,
          rope=64, num_slots=97, holes=True):  # fmt: skip
    """q, kv cache (packed fp8_ue8m0 rows or bf16 rows), slot table with -1 holes, sink."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(num_slots, head_dim, generator=g) * 2
    if kv == "fp8":
        cache = encode_rows(rows, "fp8_ue8m0", _entry_bytes(head_dim, rope), rope)
    else:
        cache = rows.bfloat16()
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(q_dtype)
    slots = torch.randint(0, num_slots, (num_tokens, num_cand), generator=g, dtype=torch.int32)
    if holes and num_cand:
        slots[torch.rand(num_tokens, num_cand, generator=g) < 0.2] = -1
    sink = torch.randn(num_heads, generator=g)
    to = lambda x: x.to(DEVICE)  # noqa: E731
    return to(q), to(cache), to(slots), to(sink), head_dim**-0.5


def _check(out, expect):
    kind_dtype = torch.bfloat16 if (DEVICE == "cuda" or out.dtype == torch.bfloat16) else out.dtype
    assert out.dtype == expect.dtype and out.shape == expect.shape
    torch.testing.assert_close(out.float(), expect.float(), **tol("activation", kind_dtype))


@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "num_cand", "kv", "q_dtype"),
    [
        (0, 4, 8, "fp8", torch.bfloat16),
        (1, 1, 1, "fp8", torch.bfloat16),
        (3, 4, 40, "fp8", torch.float32),
        (3, 4, 33, "fp8", torch.bfloat16),
        (1, 4, 17, "bf16", torch.float32),
    ],
)
def test_sparse_attention_decode_matches_ref(num_tokens, num_heads, num_cand, kv, q_dtype):
    args = _case(num_tokens, num_heads, 128, num_cand, seed=num_cand, kv=kv, q_dtype=q_dtype)
    _check(sa.sparse_attention_decode(*args), sa.sparse_attention_decode_ref(*args))


@pytest.mark.parametrize("num_splits", [2, 3])
def test_split_k_combine_matches_ref(num_splits):
    args = _case(3, 4, 128, 40, seed=7, q_dtype=torch.float32)
    args[2][1] = -1  # a token with no candidates at all: output 0 (only the sink is left)
    out = sa.sparse_attention_decode(*args, num_splits=num_splits)
    _check(out, sa.sparse_attention_decode_ref(*args))
    assert out[1].abs().max() == 0


def test_head_dim_512_one_tiny_case():
    args = _case(1, 1, 512, 5, seed=3)
    _check(sa.sparse_attention_decode(*args), sa.sparse_attention_decode_ref(*args))


def test_sparse_attention_prefill_matches_ref():
    args = _case(5, 4, 128, 24, seed=11, kv="bf16")
    _check(sa.sparse_attention_prefill(*args), sa.sparse_attention_prefill_ref(*args))


def test_no_candidates_gives_zeros():
    q, cache, _, sink, scale = _case(2, 4, 128, 0, seed=1)
    slots = torch.empty(2, 0, dtype=torch.int32, device=DEVICE)
    out = sa.sparse_attention_decode(q, cache, slots, sink, scale)
    assert torch.equal(out, sa.sparse_attention_decode_ref(q, cache, slots, sink, scale))
    assert out.abs().max() == 0


def test_ref_equals_model_sparse_attention():
    """The reference is dsv4.model.attention.sparse_attention on each token's candidates."""
    q, cache, slots, sink, scale = _case(3, 4, 128, 12, seed=5, q_dtype=torch.float32)
    out = sa.sparse_attention_decode_ref(q, cache, slots, sink, scale)
    for t in range(3):
        rows = decode_rows(cache[slots[t].clamp(min=0).long()], "fp8_ue8m0", 128, 64)
        expect = sparse_attention(q[t : t + 1], rows, (slots[t] >= 0)[None], sink, scale)
        torch.testing.assert_close(out[t : t + 1], expect, atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 128])
def test_sparse_attention_decode_production_shape_gpu(num_tokens):
    """Batch decode, window 128 + top-512 candidates, 64 heads x 512, packed fp8 rows."""
    args = _case(num_tokens, 64, 512, 640, seed=num_tokens, num_slots=60_000)
    out = sa.sparse_attention_decode(*args)
    assert_close(out, sa.sparse_attention_decode_ref(*args), "activation")
    one_split = sa.sparse_attention_decode(*args, num_splits=1)
    assert_close(one_split, out, "activation")


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_sparse_attention_prefill_production_shape_gpu(kv):
    args = _case(512, 64, 512, 640, seed=3, kv=kv, num_slots=50_000, holes=False)
    assert_close(sa.sparse_attention_prefill(*args), sa.sparse_attention_prefill_ref(*args),
                 "activation")  # fmt: skip


def test_attention_benchmark_dry_run(tmp_path):
    records = dry_run_records(tmp_path, "bench_kernels_attention")
    names = {r["name"] for r in records}
    assert {"sparse_attention_decode", "sparse_attention_prefill", "indexer_logits+topk",
            "indexer_topk", "indexer_select_all"} <= names  # fmt: skip
