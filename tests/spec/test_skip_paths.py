"""Skip paths give identical outputs (#49486): the indexer's q projection, scores and top-k
are skipped when every query's available ratio-4 entries fit in top-k."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4.model import indexer
from dsv4.model.hot_ops import REFERENCE_OPS
from dsv4.model.indexer import all_available
from dsv4.ops.indexer import indexer_topk


@pytest.fixture
def count_scores(mtp_model):
    """Counts the indexer-score calls of `mtp_model` (a spy in its hot ops)."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return REFERENCE_OPS.indexer_scores(*args, **kwargs)

    mtp_model.use_hot_ops(dataclasses.replace(REFERENCE_OPS, indexer_scores=spy))
    yield calls
    mtp_model.use_hot_ops(REFERENCE_OPS)
    indexer.set_skip_topk(True)


def test_all_available_is_the_topk_set_when_everything_fits() -> None:
    gen = torch.Generator().manual_seed(0)
    positions = torch.arange(20, 40)
    n = 40 // 4
    scores = torch.randn(20, n, generator=gen)
    ref = indexer_topk(scores, positions, 4, topk=16)
    got = all_available(positions, n, 4)
    assert got.shape == ref.shape
    for row_ref, row_got in zip(ref.tolist(), got.tolist()):
        assert sorted(i for i in row_ref if i >= 0) == sorted(i for i in row_got if i >= 0)


@pytest.mark.parametrize("length", [40, 63, 64, 90])  # (p + 1) // 4 <= top-k 16 iff p < 67
def test_forward_identical_with_and_without_skip(mtp_model, count_scores, length: int) -> None:
    ids = torch.randint(2, 1024, (1, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        indexer.set_skip_topk(False)
        off = mtp_model(ids)
        calls_off = len(count_scores)
        indexer.set_skip_topk(True)
        on = mtp_model(ids)
    assert torch.equal(on.logits, off.logits) and torch.equal(on.streams, off.streams)
    skipped = length // 4 <= mtp_model.cfg.index_topk
    assert calls_off == 2  # two ratio-4 layers scored
    assert len(count_scores) == calls_off + (0 if skipped else 2)


def test_decode_steps_identical_with_and_without_skip(mtp_model, count_scores) -> None:
    """Chunked prefill + decode through SequenceState crosses the top-k boundary (N 16 -> 17)."""
    ids = torch.randint(2, 1024, (70,), generator=torch.Generator().manual_seed(1))
    logits = {}
    with torch.no_grad():
        for skip in (False, True):
            indexer.set_skip_topk(skip)
            state = mtp_model.new_state()
            out = [mtp_model(ids[:60], states=[state]).logits]
            out += [mtp_model(ids[i : i + 1], states=[state]).logits for i in range(60, 70)]
            logits[skip] = torch.cat(out)
    assert torch.equal(logits[True], logits[False])
