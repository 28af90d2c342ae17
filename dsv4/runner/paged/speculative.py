"""MTP speculative decoding on the paged forward (the serving path on GPU).

vLLM's order: a step verifies the drafts that the previous step proposed, then proposes the
next ones from what it just verified. Per step:
1. target forward: each decode at P runs [t_P, d_1..d_k] (its stored drafts; missing ones are
   padding tokens, never accepted), prefill chunks run as usual;
2. accept: greedy exact, or rejection sampling (`dsv4.speculative.acceptance`) -> 1 + a tokens;
3. propose (`mtp_passes.MTPPasses`): the MTP layer over each decode's verified positions and
   each prefill chunk's tail writes their MTP window rows and drafts d'_1; k - 1 draft steps on
   the MTP's own streams give d'_2..d'_k.
No rollback: what a rejected position wrote (target window and compressor-state rows,
compressed entries and indexer keys of a boundary among the drafts, MTP rows) is rewritten
before anything reads it — rings hold W + k (c*r + k) slots, and an entry is visible only to
positions at or past its boundary, which recompute it in their own step before attending.

A prefill chunk's last position waits for its next token: the next chunk carries its streams
(`carry`); the final chunk uses the sampled token. After a P->D hand-off the MTP rows of the
prompt's tail arrive with the ring blocks; D's first step has no drafts and verifies padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.ops.sampling import SamplingSpec, filtered_probs
from dsv4.runner.paged.decode_graphs import DecodeGraphs
from dsv4.runner.paged.forward import PagedForward
from dsv4.runner.paged.mtp_passes import CatchUp, MTPPasses
from dsv4.runner.sampler import RequestRandom, Sampler
from dsv4.scheduler.batch import ScheduledBatch, ScheduledRequest
from dsv4.speculative.acceptance import Draft, accept_greedy, accept_sampled
from dsv4.speculative.metrics import SpecMetrics


@dataclass(frozen=True)
class _Verified:
    """The target forward of a step: logits of the sampled rows and every token's streams."""

    logits: torch.Tensor  # [rows, V] fp32
    streams: torch.Tensor  # [T, M, D]
    logit_row: dict[str, int]  # first logits row of each sampling request
    stream_row: dict[str, int]  # flat row of each request's first token
    num_rows: dict[str, int]  # verified positions of each decode (1 + drafts incl. padding)


class PagedSpeculator:
    """Owned by the `ModelRunner` (engine thread)."""

    def __init__(self, forward: PagedForward, sampler: Sampler, k: int,
                 graphs: DecodeGraphs | None = None) -> None:  # fmt: skip
        if forward.cfg.sliding_window - 2 < k:
            raise ValueError("the window must hold the verified positions: W - 2 >= k")
        self.forward, self.sampler, self.k, self.graphs = forward, sampler, k, graphs
        self.mtp = MTPPasses(forward, graphs, k)
        self.window = forward.cfg.sliding_window
        self.metrics = SpecMetrics(k)
        self.drafts: dict[str, tuple[int, Draft]] = {}  # request -> (its next position, drafts)
        self.carry: dict[str, tuple[int, torch.Tensor]] = {}  # prefill: (position, [M, D])

    def release(self, request_id: str) -> None:
        """Forget a finished or preempted request."""
        self.drafts.pop(request_id, None)
        self.carry.pop(request_id, None)

    @property
    def num_requests(self) -> int:
        """Requests it holds drafts or a carried stream for (released with the scheduler's
        finished / preempted ids of the next batch)."""
        return len(set(self.drafts) | set(self.carry))

    def step(
        self, batch: ScheduledBatch, specs: dict[str, SamplingSpec]
    ) -> dict[str, tuple[int, ...]]:
        """Run a step -> emitted tokens per sampling request (accepted drafts + 1)."""
        drafts = {r.request_id: self._drafts_for(r) for r in batch.decodes}
        verified = self._verify(batch, drafts)
        emitted = self._accept(batch, drafts, verified, specs)
        self._propose(batch, drafts, verified, emitted, specs)
        return emitted

    # ---- 1. verify ---------------------------------------------------------------------------
    def _drafts_for(self, r: ScheduledRequest) -> Draft:
        held = self.drafts.pop(r.request_id, None)
        if held is None or held[0] != r.start_position or not r.num_draft_tokens:
            return Draft((), None)
        draft = held[1]
        n = r.num_draft_tokens
        return Draft(draft.token_ids[:n], None if draft.probs is None else draft.probs[:n])

    def _verify(self, batch: ScheduledBatch, drafts: dict[str, Draft]) -> _Verified:
        tokens = {rid: d.token_ids for rid, d in drafts.items()}
        out = None
        if self.graphs is not None and not batch.prefills:
            out = self.graphs.run_target(batch.decodes, tokens)
        if out is not None:
            q = 1 + self.k
            rows = {r.request_id: i * q for i, r in enumerate(batch.requests)}
            counts = dict.fromkeys(rows, q)
            return _Verified(out[0], out[1], rows, rows, counts)
        padded = {r.request_id: (*tokens[r.request_id], *[0] * (r.num_draft_tokens - len(tokens[r.request_id])))
                  for r in batch.decodes}  # fmt: skip
        res = self.forward(batch, padded)
        step = res.tokens
        logit_row, cursor = {}, 0
        for r in batch.requests:
            if r.samples_token:
                logit_row[r.request_id] = cursor
                cursor += 1 + r.num_draft_tokens
        stream_row = {r.request_id: f for r, f in zip(batch.requests, step.first_token)}
        counts = {r.request_id: 1 + r.num_draft_tokens for r in batch.decodes}
        return _Verified(res.logits, res.streams, logit_row, stream_row, counts)

    # ---- 2. accept ---------------------------------------------------------------------------
    def _accept(self, batch, drafts, v: _Verified, specs) -> dict[str, tuple[int, ...]]:
        sampling = [r for r in batch.requests if r.samples_token]
        greedy = v.logits.argmax(-1).tolist() if any(specs[r.request_id].is_greedy
                                                      for r in sampling) else []  # fmt: skip
        emitted: dict[str, tuple[int, ...]] = {}
        plain: list[tuple[str, int]] = []  # sampled requests without drafts: the plain sampler
        for r in sampling:
            rid, spec, row = r.request_id, specs[r.request_id], v.logit_row[r.request_id]
            draft = drafts.get(rid, Draft((), None))
            n = len(draft.token_ids)
            if spec.is_greedy:
                emitted[rid] = accept_greedy(draft.token_ids, greedy[row : row + n + 1])
            elif not n:
                plain.append((rid, row))
                continue
            else:
                target = self.sampler.probs(v.logits[row : row + n + 1], [spec] * (n + 1))
                q = draft.probs.to(target.device)
                emitted[rid] = accept_sampled(draft.token_ids, q, target,
                                              RequestRandom(self.sampler, rid, spec))  # fmt: skip
            if not r.is_prefill:
                self.metrics.record(n, len(emitted[rid]) - 1)
        if plain:
            ids = [rid for rid, _ in plain]
            rows = torch.tensor([row for _, row in plain], device=v.logits.device)
            chosen = self.sampler.sample(v.logits[rows], ids, [specs[rid] for rid in ids])
            emitted.update((rid, (tok,)) for rid, tok in zip(ids, chosen))
        return emitted

    # ---- 3. propose --------------------------------------------------------------------------
    def _propose(self, batch, drafts, v: _Verified, emitted, specs) -> None:
        items: list[CatchUp] = []
        for r in batch.requests:
            rid = r.request_id
            item = (self._prefill_item(r, v, emitted.get(rid)) if r.is_prefill
                    else self._decode_item(r, v, drafts[rid], emitted[rid]))  # fmt: skip
            if item is not None:
                items.append(item)
        if not items:
            return
        logits, streams = self.mtp.catch_up(items)
        proposing = [i for i, it in enumerate(items) if it.request.request_id in emitted]
        if not proposing:
            return
        reqs = [items[i].request for i in proposing]
        rows = torch.tensor(proposing, device=logits.device)
        logits, streams = logits[rows], streams[rows]
        positions = [items[i].start + items[i].select for i in proposing]
        chosen = [self._choose(logits, reqs, specs)]
        for step in range(1, self.k):
            last = [tok for tok, _ in chosen[-1]]
            logits, streams = self.mtp.draft_step(
                reqs, [p + step for p in positions], last, streams
            )
            chosen.append(self._choose(logits, reqs, specs))
        for i, r in enumerate(reqs):
            toks = tuple(c[i][0] for c in chosen)
            probs = [c[i][1] for c in chosen]
            stacked = None if probs[0] is None else torch.stack(probs)
            # the position the request's next step starts at (its last emitted token's)
            next_position = r.end_position + len(emitted[r.request_id]) - 1
            self.drafts[r.request_id] = (next_position, Draft(toks, stacked))

    def _decode_item(self, r: ScheduledRequest, v: _Verified, draft: Draft,
                     tokens: tuple[int, ...]) -> CatchUp:  # fmt: skip
        """MTP positions P..P+n-1 (every verified row): the next token of P+j is d_{j+1}; the
        accepted drafts and then the bonus replace them up to P+a, whose output drafts."""
        n, a = v.num_rows[r.request_id], len(tokens) - 1
        row = v.stream_row[r.request_id]
        ids = [*draft.token_ids, *[0] * (n - len(draft.token_ids))][:n]
        ids[: a + 1] = tokens
        return CatchUp(r, r.start_position, tuple(ids), v.streams[row : row + n], a)

    def _prefill_item(self, r: ScheduledRequest, v: _Verified, sampled: tuple[int, ...] | None):
        rid, s, e = r.request_id, r.start_position, r.end_position
        row = v.stream_row[rid]
        carry = self.carry.pop(rid, None)
        lo = max(s, e - self.window)
        last = e if sampled else e - 1  # positions lo..last-1 know their next token
        ids = [r.token_ids[j + 1 - s] for j in range(lo, e - 1)] + ([sampled[0]] if sampled else [])
        parts = [v.streams[row + lo - s : row + last - s]]
        start = lo
        if carry is not None and lo == s:
            start, ids = s - 1, [r.token_ids[0], *ids]
            parts.insert(0, carry[1].unsqueeze(0))
        if not sampled:
            self.carry[rid] = (e - 1, v.streams[row + e - 1 - s].clone())
        if not ids:
            return None
        return CatchUp(r, start, tuple(ids), torch.cat(parts), len(ids) - 1)

    def _choose(self, logits: torch.Tensor, reqs, specs) -> list[tuple[int, torch.Tensor | None]]:
        """logits [B, V] -> (draft token, q [V] for sampled requests) per request."""
        greedy = logits.argmax(-1).tolist()
        out = []
        for i, r in enumerate(reqs):
            spec = specs[r.request_id]
            if spec.is_greedy:
                out.append((int(greedy[i]), None))
                continue
            q = filtered_probs(logits[i], spec)
            rng = RequestRandom(self.sampler, r.request_id, spec)
            out.append((rng.categorical(q), q))
        return out
