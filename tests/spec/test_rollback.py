"""Rolling back rejected draft positions is exact: a verify state over 1 + k positions,
truncated by k - a, equals the state of a forward over the 1 + a accepted positions (in
everything `store_state` writes) whenever no compressed window completed at a rejected
position; otherwise truncation refuses and the decoder replays."""

from __future__ import annotations

import pytest
import torch

from dsv4.runner.reference.rollback import can_truncate, truncate_state

K = 3


@pytest.mark.parametrize(
    ("prefix", "num_drop", "exact"),
    # Verify positions prefix..prefix+3; ratio-4 windows complete at p with (p + 1) % 4 == 0.
    [(41, 1, True), (41, 2, False), (41, 3, False), (45, 0, True), (45, 1, True),
     (45, 3, False), (46, 2, True), (46, 3, False)],
)  # fmt: skip
@torch.no_grad()
def test_truncated_state_equals_a_shorter_forward(mtp_model, prefix, num_drop, exact) -> None:
    cfg = mtp_model.cfg
    ids = torch.randint(
        2, cfg.vocab_size, (prefix + 1 + K,), generator=torch.Generator().manual_seed(prefix)
    )
    base = mtp_model.new_state()
    mtp_model(ids[:prefix], states=[base])
    verified, accepted = base.clone(), base.clone()
    mtp_model(ids[prefix:], states=[verified])  # 1 + K positions
    keep = prefix + 1 + K - num_drop
    mtp_model(ids[prefix:keep], states=[accepted])
    assert can_truncate(cfg, prefix + 1 + K, num_drop) == exact
    before = verified.clone()
    assert truncate_state(verified, cfg, num_drop) == exact
    if not exact:
        assert verified.num_tokens == before.num_tokens  # untouched
        return
    assert verified.num_tokens == accepted.num_tokens == keep
    close = dict(atol=1e-5, rtol=0)
    for got, want in zip(verified.layers, accepted.layers):
        num_new = keep - prefix  # rows store_state writes: the verified positions' own rows
        torch.testing.assert_close(got.window[-num_new:], want.window[-num_new:], **close)
        for g, w in ((got.compressor, want.compressor), (got.indexer, want.indexer)):
            if g is None:
                continue
            assert g.num_entries == w.num_entries
            if g.entries is not None:
                torch.testing.assert_close(g.entries, w.entries, **close)
            for name in ("pending_kv", "pending_gate", "overlap_kv", "overlap_gate"):
                a, b = getattr(g, name), getattr(w, name)
                assert (a is None) == (b is None), name
                if a is not None:
                    torch.testing.assert_close(a, b, **close)
