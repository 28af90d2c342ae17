"""The decode half of a step under MTP speculation: draft, verify, accept, store.

Per decode request at position P (cache holds [0, P), t_P = the token to compute):
1. draft d_1..d_k with the MTP layer (`MTPDrafter`), k = the scheduled draft count (fewer
   only when there is no MTP context yet: a request adopted after a P->D hand-off drafts
   nothing on its first step);
2. verify: ONE target forward per row over [t_P, d_1..d_k] at positions P..P+k (rows of
   equal k share the forward), giving p_0..p_k;
3. accept (greedy exact, or rejection sampling with the request's generator);
4. store exactly the accepted positions P..P+a in the paged cache (`dsv4.runner.reference.rollback`:
   truncate the state, or replay the accepted tokens when a compressed window completed
   at a rejected position), and hand the accepted positions' streams to the MTP context.
Prefill chunks only feed the MTP context (`observe`).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.ops.sampling import SamplingSpec
from dsv4.runner.kv_cache import PagedKVCache
from dsv4.runner.reference.cache_state import load_state, store_state
from dsv4.runner.reference.draft_context import DraftContext
from dsv4.runner.reference.mtp_drafter import DraftJob, MTPDrafter
from dsv4.runner.reference.rollback import truncate_state
from dsv4.runner.sampler import RequestRandom, Sampler
from dsv4.scheduler.batch import ScheduledRequest
from dsv4.speculative.acceptance import Draft, accept_greedy, accept_sampled
from dsv4.speculative.metrics import SpecMetrics

NO_DRAFT = Draft((), None)


class SpeculativeDecoder:
    """Owned by the `ModelRunner` (engine thread). Keeps one `DraftContext` per request."""

    def __init__(
        self, model: DeepseekV4, cache: PagedKVCache, sampler: Sampler, num_speculative_tokens: int
    ) -> None:
        if model.cfg.sliding_window - 2 < num_speculative_tokens:
            raise ValueError("the window must hold the verified positions: W - 2 >= k")
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.drafter = MTPDrafter(model, cache)
        self.metrics = SpecMetrics(num_speculative_tokens)
        self.contexts: dict[str, DraftContext] = {}
        self.window = model.cfg.sliding_window
        self.dtype = model.embed.weight.dtype
        self.device = model.embed.weight.device

    def release(self, request_id: str) -> None:
        """Forget a finished or preempted request's context."""
        self.contexts.pop(request_id, None)

    def observe(self, req: ScheduledRequest, streams: torch.Tensor) -> None:
        """After a prefill chunk's forward: streams [S, M, D] of positions req's tokens."""
        ctx = self._context_at(req.request_id, req.start_position)
        ctx.append(req.token_ids, streams, self.window)

    def decode(
        self, requests: tuple[ScheduledRequest, ...], specs: list[SamplingSpec]
    ) -> dict[str, tuple[int, ...]]:
        """Run every decode of the step -> emitted tokens (accepted drafts + 1) per request."""
        rngs = [RequestRandom(self.sampler, r.request_id, s) for r, s in zip(requests, specs)]
        jobs, job_rows = [], []
        for row, (req, spec, rng) in enumerate(zip(requests, specs, rngs)):
            ctx = self._context_at(req.request_id, req.start_position)
            if req.num_draft_tokens and ctx.num_pending:
                jobs.append(DraftJob(req, ctx, req.num_draft_tokens, spec, rng))
                job_rows.append(row)
        drafts = [NO_DRAFT] * len(requests)
        for row, draft in zip(job_rows, self.drafter.propose(jobs)):
            drafts[row] = draft
        by_len: dict[int, list[int]] = defaultdict(list)
        for row, draft in enumerate(drafts):
            by_len[len(draft.token_ids)].append(row)
        emitted: dict[str, tuple[int, ...]] = {}
        replays: dict[int, list[tuple[ScheduledRequest, tuple[int, ...]]]] = defaultdict(list)
        for rows in by_len.values():
            group = [(requests[r], drafts[r], specs[r], rngs[r]) for r in rows]
            for req, tokens, replay in self._verify(group):
                emitted[req.request_id] = tokens
                if replay:
                    replays[len(tokens)].append((req, (req.token_ids[0], *tokens[:-1])))
        for group in replays.values():
            self._replay(group)
        return emitted

    # ---- internals -----------------------------------------------------------------------
    def _context_at(self, request_id: str, position: int) -> DraftContext:
        ctx = self.contexts.get(request_id)
        if ctx is None or ctx.end != position:  # new, recomputed after preemption, or adopted
            ctx = self.contexts[request_id] = DraftContext.fresh(position)
        return ctx

    def _verify(self, group):
        """One target forward over [t_P, d_1..d_k] per row -> (request, emitted, needs replay)."""
        states = [load_state(self.cache, req, self.dtype) for req, *_ in group]
        ids = torch.tensor(
            [[req.token_ids[0], *draft.token_ids] for req, draft, *_ in group],
            dtype=torch.long,
            device=self.device,
        )  # [B, 1 + k]
        out = self.model(ids, states=states)  # logits [B, 1 + k, V]
        results = []
        for row, (req, draft, spec, rng) in enumerate(group):
            tokens = self._accept(out.logits[row], draft, spec, rng)
            k, a = len(draft.token_ids), len(tokens) - 1
            self.metrics.record(k, a)
            start = req.start_position
            exact = truncate_state(states[row], self.model.cfg, k - a)
            if exact:
                store_state(self.cache, req, states[row], start, start + a + 1)
            accepted = (req.token_ids[0], *draft.token_ids[:a])
            self.contexts[req.request_id].append(accepted, out.streams[row, : a + 1], self.window)
            results.append((req, tokens, not exact))
        return results

    def _accept(self, logits: torch.Tensor, draft: Draft, spec: SamplingSpec, rng) -> tuple:
        """logits [1 + k, V] -> emitted tokens."""
        if spec.is_greedy:
            return accept_greedy(draft.token_ids, logits.argmax(dim=-1).tolist())
        k = len(draft.token_ids)
        target = self.sampler.probs(logits, [spec] * (k + 1))  # [1 + k, V]
        q = draft.probs if draft.probs is not None else target.new_zeros(0, target.shape[-1])
        return accept_sampled(draft.token_ids, q.to(target.device), target, rng)

    def _replay(self, group: list[tuple[ScheduledRequest, tuple[int, ...]]]) -> None:
        """Recompute accepted positions P..P+a from the paged cache (still at P) and store."""
        states = [load_state(self.cache, req, self.dtype) for req, _ in group]
        ids = torch.tensor([tokens for _, tokens in group], dtype=torch.long, device=self.device)
        self.model(ids, states=states, last_only=True)
        for (req, _), state in zip(group, states):
            store_state(self.cache, req, state, req.start_position, state.num_tokens)
