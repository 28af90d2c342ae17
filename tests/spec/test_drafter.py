"""MTP drafting through the paged cache equals the reference MTP over the whole sequence:
catch-up across calls (window rows stored in the MTP layer's ring, long contexts trimmed to
the window) and the feed-back step 2 (the MTP's own streams + the drafted token)."""

from __future__ import annotations

import torch

from dsv4.cache.layout import KVLayout
from dsv4.cache.packing import CacheOptions
from dsv4.ops.sampling import SamplingSpec
from dsv4.runner.kv_cache import PagedKVCache
from dsv4.runner.reference.draft_context import DraftContext
from dsv4.runner.reference.mtp_drafter import DraftJob, MTPDrafter
from dsv4.runner.sampler import RequestRandom, Sampler
from dsv4.scheduler.batch import ScheduledRequest

LENGTH = 80


def _decode(position: int, token: int, ring: tuple[int, ...]) -> ScheduledRequest:
    return ScheduledRequest("r", (token,), position, False, 2, True, (), ring)


@torch.no_grad()
def test_drafts_match_the_reference_mtp(mtp_model) -> None:
    cfg = mtp_model.cfg
    ids = torch.randint(2, cfg.vocab_size, (LENGTH,), generator=torch.Generator().manual_seed(0))
    streams = mtp_model(ids).streams  # [L, M, D]
    ref = mtp_model.mtp_forward(streams[:-1], ids[1:]).logits  # [L-1, V]: token i+2 at row i
    layout = KVLayout.build(cfg, CacheOptions(block_size=128, kv_dtype="fp32",
                                              index_dtype="fp32", num_speculative_tokens=2))  # fmt: skip
    cache = PagedKVCache(layout, num_blocks=layout.num_ring_blocks)
    ring = tuple(range(layout.num_ring_blocks))
    drafter = MTPDrafter(mtp_model, cache)
    spec = SamplingSpec(temperature=1.0, seed=0)
    rng = RequestRandom(Sampler(), "r", spec)
    ctx = DraftContext.fresh(0)
    ctx.append(tuple(ids[:50].tolist()), streams[:50], cfg.sliding_window)  # a 50-token prefill
    assert ctx.start == 50 - cfg.sliding_window == ctx.valid_from  # trimmed, exactly
    for position in (50, 53):  # the second call reads rows the first one stored
        job = DraftJob(_decode(position, int(ids[position]), ring), ctx, 2, spec, rng)
        (draft,) = drafter.propose([job])
        expected = torch.softmax(ref[position - 1], dim=-1)
        torch.testing.assert_close(draft.probs[0], expected, atol=1e-5, rtol=0)
        assert ctx.end == position and ctx.num_pending == 0
        ctx.append(tuple(ids[position : position + 3].tolist()), streams[position : position + 3],
                   cfg.sliding_window)  # fmt: skip
    # Step 2 at P = 53: the MTP at position 53 on its own streams at 52 and the drafted d_1.
    state = mtp_model.new_state()
    out = mtp_model.mtp_forward(streams[:53], ids[1:54], states=[state])
    step2 = mtp_model.mtp_forward(out.streams[-1:], torch.tensor([draft.token_ids[0]]),
                                  states=[state])  # fmt: skip
    expected = torch.softmax(step2.logits[-1], dim=-1)
    torch.testing.assert_close(draft.probs[1], expected, atol=1e-5, rtol=0)
