"""Draft k tokens with the MTP layer (docs/model.md#mtp), reusing it for steps 2..k.

For a request whose cache holds positions [0, P) and whose next token t_P is known:
1. catch-up: the MTP layer reads every pending target position j in [start, P) of the
   request's `DraftContext` with streams_j and token_{j+1} (t_P for j = P - 1), in one
   forward. Its window rows of those positions are verified ones: they are stored in the MTP
   layer's window ring (layer id num_hidden_layers). The output at P - 1 gives q_1 -> d_1.
2. steps 2..k, as vLLM: feed back the MTP's own post-block streams at the previous step and
   the token just drafted (MTP positions P, P+1, ...). Those window rows are drafts: they stay
   in the in-memory state and are never stored, so nothing needs rolling back for the MTP.

Requests are batched: catch-up rows of equal pending length in one forward, then one forward
per draft step over every request still drafting. Greedy requests draft argmax q; sampled
requests draw d_i ~ q_i (temperature/top-k/top-p applied) from their own generator.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.model.state import SequenceState
from dsv4.ops.sampling import SamplingSpec, filtered_probs
from dsv4.runner.kv_cache import PagedKVCache
from dsv4.runner.reference.cache_state import load_mtp_window, store_mtp_window
from dsv4.runner.reference.draft_context import DraftContext
from dsv4.scheduler.batch import ScheduledRequest
from dsv4.speculative.acceptance import Draft, RandomSource


@dataclass(frozen=True)
class DraftJob:
    request: ScheduledRequest  # decode at P = request.start_position, t_P = token_ids[0]
    context: DraftContext  # must end at P with at least one pending position
    num_drafts: int
    spec: SamplingSpec
    rng: RandomSource


class MTPDrafter:
    def __init__(self, model: DeepseekV4, cache: PagedKVCache) -> None:
        if not len(model.mtp):
            raise ValueError("MTP drafting needs a model with an MTP layer")
        self.model = model
        self.cache = cache
        self.window = model.cfg.sliding_window
        self.dtype = model.embed.weight.dtype
        self.device = model.embed.weight.device

    def propose(self, jobs: list[DraftJob]) -> list[Draft]:
        """One `Draft` per job, in order. Consumes each job's context (see module docstring)."""
        if not jobs:
            return []
        logits: list[torch.Tensor] = [None] * len(jobs)  # type: ignore[list-item]  # [V]
        feed: list[torch.Tensor] = [None] * len(jobs)  # type: ignore[list-item]  # [M, D]
        states: list[SequenceState] = [None] * len(jobs)  # type: ignore[list-item]
        by_len: dict[int, list[int]] = defaultdict(list)
        for i, job in enumerate(jobs):
            assert job.context.end == job.request.start_position and job.context.num_pending
            by_len[job.context.num_pending].append(i)
        for indices in by_len.values():
            self._catch_up([jobs[i] for i in indices], indices, logits, feed, states)
        tokens: list[list[int]] = [[] for _ in jobs]
        probs: list[list[torch.Tensor]] = [[] for _ in jobs]
        for step in range(max(job.num_drafts for job in jobs)):
            active = [i for i, job in enumerate(jobs) if job.num_drafts > step]
            if step:
                self._feed_back(active, tokens, logits, feed, states)
            for i in active:
                token, q = _choose(logits[i], jobs[i])
                tokens[i].append(token)
                if q is not None:
                    probs[i].append(q)
        return [Draft(tuple(t), torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def _catch_up(self, group, indices, logits, feed, states) -> None:
        """MTP over each request's pending positions [start, P); stores their window rows."""
        w = self.window
        group_states = []
        for job in group:
            ctx, ring = job.context, job.request.ring_block_ids
            lo = max(ctx.valid_from, ctx.start - (w - 1))
            layer = load_mtp_window(self.cache, ring, lo, ctx.start, self.dtype)
            group_states.append(SequenceState(job.request.start_position, [], layer, ctx.start))
        streams = torch.stack([job.context.streams for job in group])  # [B, n, M, D]
        ids = torch.tensor(
            [[*job.context.tokens[1:], job.request.token_ids[0]] for job in group],
            dtype=torch.long,
            device=self.device,
        )  # [B, n]: token_{j+1} for every pending j
        out = self.model.mtp_forward(streams, ids, states=group_states, last_only=True)
        for row, (i, job) in enumerate(zip(indices, group)):
            state = group_states[row]
            end, n = job.request.start_position, job.context.num_pending
            stored = store_mtp_window(self.cache, job.request.ring_block_ids, state.mtp, end, n)
            job.context.consume(stored)
            logits[i], feed[i], states[i] = out.logits[row, -1], out.streams[row, -1], state

    def _feed_back(self, active, tokens, logits, feed, states) -> None:
        """One draft step for every active request: its own streams + its last draft."""
        streams = torch.stack([feed[i] for i in active]).unsqueeze(1)  # [B, 1, M, D]
        ids = torch.tensor([[tokens[i][-1]] for i in active], dtype=torch.long, device=self.device)
        out = self.model.mtp_forward(streams, ids, states=[states[i] for i in active])
        for row, i in enumerate(active):
            logits[i], feed[i] = out.logits[row, -1], out.streams[row, -1]


def _choose(logits: torch.Tensor, job: DraftJob) -> tuple[int, torch.Tensor | None]:
    """logits [V] -> (draft token, q [V] for sampled requests)."""
    if job.spec.is_greedy:
        return int(logits.argmax()), None
    q = filtered_probs(logits, job.spec)
    return job.rng.categorical(q), q
