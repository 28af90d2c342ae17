"""Indexer logits + top-k, streamlined (kernels/indexer_fused.py), against the composition of
the references of `indexer_logits` and `indexer_topk` (selections compared as sets), and its
top-k against the default top-k on scores with ties."""

from __future__ import annotations

import importlib

import pytest
import torch

import kernels.indexer_fused as fused
from tests.kernels.conftest import DEVICE
from tests.kernels.sm90_build import sass_lines
from tests.kernels.test_indexer import (
    PRODUCTION,
    _batch,
    _close_scores,
    _paged_keys,
    _same_sets,
    ix,
    production_case,
    sel,
)

if fused.indexer_logits is not ix.indexer_logits:  # test_indexer reloaded the kernel modules
    fused = importlib.reload(fused)


def _args(fmt, num_tokens, num_heads, lengths, seed=0):
    table, t2r, lens, g = _batch(num_tokens, lengths, seed=seed)
    keys = _paged_keys(fmt, 64, 8, 128, g)
    q = torch.randn(num_tokens, num_heads, 128, generator=g).to(DEVICE)
    w = torch.randn(num_tokens, num_heads, generator=g).to(DEVICE)
    return (q, w, keys, table, t2r, lens)


@pytest.mark.parametrize("fmt", ["fp8_fp32scale", "mxfp4", "plain"])
@pytest.mark.parametrize(("num_tokens", "k"), [(0, 4), (1, 5), (3, 7), (3, 64)])
def test_indexer_logits_topk_matches_ref(fmt, num_tokens, k):
    args = _args(fmt, num_tokens, 4, [37, 5, 9], seed=k)
    kw = dict(key_format=fmt, num_cols=41, slots_per_block=20, slot_base=3)
    got = fused.indexer_logits_topk(*args, k, 8, **kw)
    _same_sets(got, fused.indexer_logits_topk_ref(*args, k, 8, **kw))


def test_every_mxfp4_code_decodes_exactly():
    """Keys holding all 16 nibbles (both signs, 0, the subnormal-placed 0.5) and block scales
    above and below 1: the bit-placement decode gives decode_rows' values (one head, w = 1,
    q = a unit vector picks one dimension per token: the score is relu of that key value)."""
    g = torch.Generator().manual_seed(2)
    table, t2r, lens, _ = _batch(1, [40])
    keys = _paged_keys("mxfp4", 64, 8, 128, g)
    nibbles = torch.arange(64, dtype=torch.uint8) % 16
    keys[:, :, :64] = (nibbles | (nibbles.roll(3) << 4)).to(DEVICE)
    keys[:, :, 64:68] = torch.tensor([120, 127, 131, 140], dtype=torch.uint8, device=DEVICE)
    w = torch.ones(1, 1, device=DEVICE)
    for dim in (0, 5, 37, 101, 127):
        q = torch.zeros(1, 1, 128, device=DEVICE)
        q[0, 0, dim] = 1.0
        args = (q, w, keys, table, t2r, lens)
        scores = ix.indexer_logits(*args, key_format="mxfp4", num_cols=40, fast=True)
        expect = ix.indexer_logits_ref(*args, key_format="mxfp4", num_cols=40)
        assert torch.equal(scores, expect), dim


@pytest.mark.parametrize("scores_kind", ["random", "ties", "signed_zeros", "neg_inf"])
def test_radix_topk_matches_ref(scores_kind):
    """The radix select against the reference top-k on rows of up to 300 scores (token 3 is
    padding), with many ties, signed zeros and -inf scores."""
    table, t2r, lens, g = _batch(4, [300, 5, 9, 290], entries=16, max_blocks=32)
    shape = (4, 300)
    scores = {
        "random": torch.randn(shape, generator=g),
        "ties": torch.randint(-3, 3, shape, generator=g).float(),
        "signed_zeros": torch.where(torch.rand(shape, generator=g) < 0.5, -0.0, 0.0),
        "neg_inf": torch.where(torch.rand(shape, generator=g) < 0.5, float("-inf"), 1.0),
    }[scores_kind].to(DEVICE)
    for k in (1, 64, 299):
        args = (scores, lens, k, t2r, table, 16)
        _same_sets(sel.indexer_topk(*args, radix=True), sel.indexer_topk_ref(*args))


def test_radix_topk_streamed_rows(monkeypatch):
    """Rows longer than the register budget: each radix round sums chunk histograms."""
    monkeypatch.setattr(sel, "_MAX_ROW_IN_REGISTERS", 64)
    table, t2r, lens, g = _batch(3, [300, 290, 9], entries=16, max_blocks=32)
    scores = torch.randint(-20, 20, (3, 300), generator=g).float().to(DEVICE)
    for k in (7, 100):
        args = (scores, lens, k, t2r, table, 16)
        kw = {"slots_per_block": 45, "slot_base": 13, "radix": True}
        _same_sets(sel.indexer_topk(*args, **kw), sel.indexer_topk_ref(*args, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_fp32scale", "mxfp4"])
def test_indexer_logits_topk_production_shape_gpu(fmt):
    """Decode at 32K context: 64 tokens x 8192 compressed keys, 64 heads x 128, top-512: the
    scores within tolerance of the reference, the top-k of those scores equal as sets."""
    num_keys, entries, k = (PRODUCTION[n] for n in ("num_keys", "entries", "k"))
    args = production_case(fmt)
    _, _, _, table, t2r, lens = args
    scores = ix.indexer_logits(*args, key_format=fmt, num_cols=num_keys, fast=True)
    expect = ix.indexer_logits_ref(*args, key_format=fmt, num_cols=num_keys)
    _close_scores(scores, expect)
    top = (scores, lens, k, t2r, table, entries)
    _same_sets(sel.indexer_topk(*top, radix=True), sel.indexer_topk_ref(*top))
    _same_sets(fused.indexer_logits_topk(*args, k, entries, key_format=fmt, num_cols=num_keys),
               sel.indexer_topk_ref(*top))  # fmt: skip


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU's sm_90 compile; a GPU runs the kernels")
def test_sm90_compile_of_the_variants_has_no_spills():
    """The FAST logits kernel at every autotuner config (fp16 dot for FP8 keys, the bit-placed
    MXFP4 decode) and the radix top-k at 8192 scores compile for sm_90a without spills."""
    lines = sass_lines("index new") + sass_lines("index topk new")
    assert len(lines) == 2 * len(ix._GPU_CONFIGS) + 1, lines
    assert all(" stack    0 " in line for line in lines), lines
