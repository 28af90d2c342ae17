"""Forget rejected draft positions: make the paged cache hold exactly the accepted ones.

A verify forward advances a request's `SequenceState` over P..P+k (last token + k drafts);
with a < k drafts accepted, the cache must end up as if only P..P+a had been computed. What
the forward left in the state, per part (end = P + k + 1, keep = P + a + 1):

- window rows: a row depends only on its own position's input, so the rows of P..P+a are
  exact; `store_state` writes only rows of [P, keep) (the rejected rows are never written,
  and the ring's k spare slots would absorb them if a kernel wrote them in place).
- compressor / indexer pending rows ([a | z + ape] per position) of the incomplete window:
  exact per position, so dropping the last k - a rows is exact IF those rows are still in
  `pending`, i.e. no compressed window completed at a rejected position
  (keep // r == end // r for every compress ratio r).
- compressed entries and the ratio-4 overlap: unchanged under the same condition.

When a window did complete at a rejected position, the state has folded that window's rows
(accepted ones included) into an entry that must not survive, and no longer holds the rows.
Then the decoder replays the accepted tokens P..P+a from the state loaded again from the
paged cache (untouched until the store, so it is the snapshot) and stores that. Both paths
are exact; the replay costs one forward of a + 1 tokens and is taken with probability
about (k - a) / 4 per rejection on ratio-4 layers.
"""

from __future__ import annotations

from dsv4.config.model import ModelConfig
from dsv4.model.state import SequenceState


def can_truncate(cfg: ModelConfig, end: int, num_drop: int) -> bool:
    """No compressed window of any main layer completes at positions [end - num_drop, end)."""
    keep = end - num_drop
    ratios = {r for r in cfg.compress_ratios if r}
    return all(keep // r == end // r for r in ratios)


def truncate_state(state: SequenceState, cfg: ModelConfig, num_drop: int) -> bool:
    """Drop the last `num_drop` positions of `state` in place when that is exact (see the
    module docstring); returns False and leaves `state` untouched otherwise.

    NOTE: the truncated window holds fewer than W - 1 rows (the oldest ones left with the
    forward): the state is good for `store_state(..., start, keep)` only, not for further
    forwards.
    """
    end = state.num_tokens
    if num_drop == 0:
        return True
    if not can_truncate(cfg, end, num_drop):
        return False
    for layer in state.layers:
        if layer.window is not None:
            assert layer.window.shape[0] > num_drop, "window shorter than the dropped span"
            layer.window = layer.window[:-num_drop]
        for comp in (layer.compressor, layer.indexer):
            if comp is None:
                continue
            assert comp.pending_kv is not None and comp.pending_kv.shape[0] >= num_drop
            comp.pending_kv = comp.pending_kv[:-num_drop]
            comp.pending_gate = comp.pending_gate[:-num_drop]
    state.num_tokens = end - num_drop
    return True
