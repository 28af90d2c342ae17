"""Execute one `ScheduledBatch` on the model over the paged cache and sample.

Decodes (one token each) run as one batched forward; each prefill chunk runs as its own row
(rows of one forward must have equal lengths). Every request's state is loaded from the paged
cache, advanced by the model, and its changes stored back, so the cache alone carries a request
between steps (and between workers, after a KV hand-off).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.runner.paged_cache import PagedKVCache
from dsv4.runner.paged_state import load_state, store_state
from dsv4.runner.sampler import Sampler, SamplingSpec
from dsv4.scheduler.batch import RequestStepOutput, ScheduledBatch, ScheduledRequest, StepOutput


@dataclass(frozen=True)
class StepStats:
    """What one execute() did, for metrics and benchmarks."""

    num_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    seconds: float


def sampling_spec(params: object) -> SamplingSpec:
    """The sampler's view of a request's sampling parameters (any object with the fields)."""
    if params is None:
        return SamplingSpec()
    if isinstance(params, SamplingSpec):
        return params
    return SamplingSpec(
        temperature=float(getattr(params, "temperature", 0.0) or 0.0),
        top_p=float(getattr(params, "top_p", 1.0) or 1.0),
        top_k=int(getattr(params, "top_k", 0) or 0),
        seed=getattr(params, "seed", None),
    )


class ModelRunner:
    def __init__(self, model: DeepseekV4, cache: PagedKVCache, sampler: Sampler | None = None):
        self.model = model
        self.cache = cache
        self.sampler = sampler or Sampler()
        self.device = model.embed.weight.device
        self.dtype = model.embed.weight.dtype

    @torch.no_grad()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        for request_id in batch.finished_request_ids:
            self.sampler.release(request_id)
        if any(r.num_draft_tokens for r in batch.requests):
            raise NotImplementedError("draft tokens need the speculative decoder")
        logits: dict[str, torch.Tensor] = {}
        decodes = batch.decodes
        if decodes:
            logits.update(self._forward(decodes))
        for prefill in batch.prefills:
            logits.update(self._forward((prefill,)))
        sampled = [r for r in batch.requests if r.samples_token]
        if not sampled:
            return StepOutput(tuple(RequestStepOutput(r.request_id) for r in batch.requests))
        stacked = torch.stack([logits[r.request_id] for r in sampled])  # [B, V]
        ids = [r.request_id for r in sampled]
        tokens = self.sampler.sample(
            stacked, ids, [sampling_spec(r.sampling_params) for r in sampled]
        )
        by_id = dict(zip(ids, tokens))
        return StepOutput(
            tuple(
                RequestStepOutput(r.request_id, (by_id[r.request_id],) if r.samples_token else ())
                for r in batch.requests
            )
        )

    def _forward(self, requests: tuple[ScheduledRequest, ...]) -> dict[str, torch.Tensor]:
        """Rows of equal length -> last-position logits [V] per request."""
        states = [load_state(self.cache, r, self.dtype) for r in requests]
        ids = torch.tensor([r.token_ids for r in requests], dtype=torch.long, device=self.device)
        out = self.model(ids, states=states, last_only=True)
        for req, state in zip(requests, states):
            store_state(self.cache, req, state, req.start_position, req.end_position)
        return {r.request_id: out.logits[i, -1] for i, r in enumerate(requests)}
