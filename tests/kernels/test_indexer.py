"""Lightning indexer (kernels/indexer.py logits, kernels/indexer_select.py top-k and the
select-everything path) against their references, and the references against dsv4.model.indexer.
Selection kernels are compared as sets of slots."""

from __future__ import annotations

import importlib

import pytest
import torch

import kernels.indexer as ix
import kernels.indexer_select as sel
from dsv4.ops.indexer import indexer_scores
from dsv4.ops.indexer import indexer_topk as model_indexer_topk
from dsv4.ops.kv_codec import decode_rows, encode_rows
from tests.kernels.conftest import DEVICE
from tests.kernels.tolerances import tol

if DEVICE == "cpu":  # kernels imported before TRITON_INTERPRET was set: re-decorate ours
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(ix._logits_kernel, InterpretedFunction):
        ix, sel = importlib.reload(ix), importlib.reload(sel)

ROW_BYTES = {"fp8_fp32scale": lambda d: d + 4, "mxfp4": lambda d: d // 2 + d // 32}


def _paged_keys(fmt, num_blocks, entries, head_dim, g, stride_pad=48):
    """A paged key view [num_blocks, E, row] inside a wider backing, as the cache layout has."""
    rows = torch.randn(num_blocks * entries, head_dim, generator=g)
    if fmt == "plain":
        return rows.view(num_blocks, entries, head_dim).to(DEVICE)
    row = ROW_BYTES[fmt](head_dim)
    backing = torch.zeros(num_blocks, entries * row + 2 * stride_pad, dtype=torch.uint8)
    backing[:, stride_pad : stride_pad + entries * row] = encode_rows(rows, fmt, row, 0).view(
        num_blocks, -1
    )
    return backing.to(DEVICE)[:, stride_pad : stride_pad + entries * row].view(
        num_blocks, entries, row
    )


def _batch(num_tokens, lengths, num_reqs=2, entries=8, max_blocks=6, seed=0):
    """block_table [B, nb], token_to_req [T] (last token = padding when T > 1), lengths [T]."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(64, generator=g)[: num_reqs * max_blocks].view(num_reqs, max_blocks)
    t2r = torch.arange(num_tokens, dtype=torch.int32) % num_reqs
    if num_tokens > 1:
        t2r[-1] = -1
    lens = torch.tensor(lengths[:num_tokens], dtype=torch.int32)
    return table.int().to(DEVICE), t2r.to(DEVICE), lens.to(DEVICE), g


def _close_scores(out, expect):
    finite = torch.isfinite(expect)
    assert torch.equal(torch.isfinite(out), finite)
    scale = expect[finite].abs().max().clamp(min=1.0) if finite.any() else 1.0
    torch.testing.assert_close(out[finite] / scale, expect[finite] / scale,
                               **tol("hc_mix", torch.float32))  # fmt: skip


@pytest.mark.parametrize("fmt", ["fp8_fp32scale", "mxfp4", "plain"])
@pytest.mark.parametrize(("num_tokens", "num_heads"), [(0, 4), (1, 1), (3, 4)])
def test_indexer_logits_matches_ref(fmt, num_tokens, num_heads):
    table, t2r, lens, g = _batch(num_tokens, [37, 5, 9])
    keys = _paged_keys(fmt, 64, 8, 128, g)
    q = torch.randn(num_tokens, num_heads, 128, generator=g).to(DEVICE)
    w = torch.randn(num_tokens, num_heads, generator=g).to(DEVICE)
    args = (q, w, keys, table, t2r, lens)
    out = ix.indexer_logits(*args, key_format=fmt, num_cols=41)
    _close_scores(out, ix.indexer_logits_ref(*args, key_format=fmt, num_cols=41))


def test_indexer_logits_ref_equals_model_scores():
    table, t2r, lens, g = _batch(3, [19, 11, 5], num_reqs=2)  # token 2 is padding
    keys = _paged_keys("mxfp4", 64, 8, 128, g)
    q, w = torch.randn(3, 4, 128, generator=g), torch.randn(3, 4, generator=g)
    out = ix.indexer_logits_ref(q.to(DEVICE), w.to(DEVICE), keys, table, t2r, lens,
                                key_format="mxfp4")  # fmt: skip
    for t in range(2):
        n, req = int(lens[t]), int(t2r[t])
        i = torch.arange(n, device=DEVICE)
        rows = keys[table[req].long()[i // 8], i % 8]
        k = decode_rows(rows, "mxfp4", 128, 0)
        expect = indexer_scores(q[t : t + 1], k.cpu(), w[t : t + 1])[0]
        torch.testing.assert_close(out[t, :n].cpu(), expect, atol=1e-4, rtol=1e-5)
        assert torch.isinf(out[t, n:]).all()
    assert torch.isinf(out[2]).all()


def _same_sets(got, expect):
    (slots, lens), (slots_ref, lens_ref) = got, expect
    assert slots.dtype == torch.int32 and slots.shape == slots_ref.shape
    assert torch.equal(lens, lens_ref)
    assert torch.equal(slots.sort(dim=1).values, slots_ref.sort(dim=1).values)


@pytest.mark.parametrize("scores_kind", ["random", "ties", "signed_zeros"])
@pytest.mark.parametrize("k", [1, 5, 64])
def test_indexer_topk_matches_ref_as_sets(scores_kind, k):
    table, t2r, lens, g = _batch(4, [37, 5, 9, 41])
    shape = (4, 41)
    scores = {
        "random": torch.randn(shape, generator=g),
        "ties": torch.randint(-3, 3, shape, generator=g).float(),  # ties: lower index wins
        "signed_zeros": torch.where(torch.rand(shape, generator=g) < 0.5, -0.0, 0.0),
    }[scores_kind].to(DEVICE)
    args = (scores, lens, k, t2r, table, 8)
    _same_sets(sel.indexer_topk(*args), sel.indexer_topk_ref(*args))


def test_indexer_topk_streamed_rows_and_flat_slot_ids(monkeypatch):
    """Rows longer than the register budget are streamed; slots in the layout's flat view."""
    monkeypatch.setattr(sel, "_MAX_ROW_IN_REGISTERS", 32)
    table, t2r, lens, g = _batch(3, [37, 40, 9])
    scores = torch.randn(3, 40, generator=g).to(DEVICE)
    args = (scores, lens, 7, t2r, table, 8)
    kw = {"slots_per_block": 45, "slot_base": 13}
    _same_sets(sel.indexer_topk(*args, **kw), sel.indexer_topk_ref(*args, **kw))


def test_indexer_topk_empty():
    table, t2r, lens, _ = _batch(0, [])
    scores = torch.empty(0, 16, device=DEVICE)
    slots, lens_out = sel.indexer_topk(scores, lens, 4, t2r, table, 8)
    assert slots.shape == (0, 4) and lens_out.shape == (0,)


def test_indexer_topk_ref_follows_model_semantics():
    """Local indices of dsv4.model.indexer.indexer_topk (positions, ratio 4) as identity slots."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(-4, 4, (5, 30), generator=g).float()
    positions = torch.tensor([3, 17, 64, 119, 80])
    model = model_indexer_topk(scores, positions, 4, 8)
    ident = torch.zeros(1, 1, dtype=torch.int32)
    slots, _ = sel.indexer_topk_ref(scores, ((positions + 1) // 4).int(), 8,
                                    torch.zeros(5, dtype=torch.int32), ident, 64)  # fmt: skip
    assert torch.equal(slots.long(), model)


@pytest.mark.parametrize(("num_tokens", "k"), [(0, 8), (1, 8), (4, 8), (5, 13)])
def test_indexer_select_all_matches_ref_and_topk(num_tokens, k):
    table, t2r, lens, g = _batch(num_tokens, [7, 8, 0, 3, 13])
    lens = lens.clamp(max=k)
    args = (lens, k, t2r, table, 8)
    got = sel.indexer_select_all(*args, slots_per_block=20, slot_base=3)
    expect = sel.indexer_select_all_ref(*args, slots_per_block=20, slot_base=3)
    assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1])
    scores = torch.randn(num_tokens, 16, generator=g).to(DEVICE)  # no row exceeds k: same set
    _same_sets(sel.indexer_topk(scores, *args, slots_per_block=20, slot_base=3), expect)


PRODUCTION = {"num_tokens": 64, "num_keys": 8192, "entries": 64, "k": 512}


def production_case(fmt):
    """Decode at 32K context: 64 tokens x 8192 compressed keys (each token its own request,
    4K-8K visible), 64 heads x 128 -> (q, w, keys, block_table, token_to_req, lengths)."""
    num_tokens, num_keys, entries = (PRODUCTION[n] for n in ("num_tokens", "num_keys", "entries"))
    g = torch.Generator().manual_seed(0)
    blocks = num_keys // entries
    keys = _paged_keys(fmt, num_tokens * blocks, entries, 128, g)
    table = torch.randperm(num_tokens * blocks, generator=g).int().view(num_tokens, blocks)
    table, t2r = table.to(DEVICE), torch.arange(num_tokens, dtype=torch.int32, device=DEVICE)
    lens = torch.randint(num_keys // 2, num_keys + 1, (num_tokens,), generator=g).int()
    q = torch.randn(num_tokens, 64, 128, generator=g).to(DEVICE).bfloat16()
    w = (torch.randn(num_tokens, 64, generator=g) / 90.5).to(DEVICE)
    return q, w, keys, table, t2r, lens.to(DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_fp32scale", "mxfp4"])
def test_indexer_production_shape_gpu(fmt):
    """Decode at 32K context: 64 tokens x 8192 compressed keys, 64 heads x 128, top-512."""
    num_keys, entries, k = (PRODUCTION[n] for n in ("num_keys", "entries", "k"))
    args = production_case(fmt)
    _, _, _, table, t2r, lens = args
    scores = ix.indexer_logits(*args, key_format=fmt, num_cols=num_keys)
    _close_scores(scores, ix.indexer_logits_ref(*args, key_format=fmt, num_cols=num_keys))
    top = (scores, lens, k, t2r, table, entries)
    _same_sets(sel.indexer_topk(*top), sel.indexer_topk_ref(*top))
    short = (lens.clamp(max=k), k, t2r, table, entries)
    _same_sets(sel.indexer_select_all(*short), sel.indexer_select_all_ref(*short))
