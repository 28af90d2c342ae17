"""Execute one `ScheduledBatch`: forward -> sample -> `StepOutput`.

The forward is a `dsv4.runner.step_forward.StepForward`: the reference forward
(`dsv4.runner.reference`, the oracle) or the paged forward (`dsv4.runner.paged`, the GPU
serving path), each with its own MTP speculative half. It leaves the logits of the requests to
sample, and the tokens its speculative half already chose; the runner samples the rest.
"""

from __future__ import annotations

import torch

from dsv4.runner.kv_cache import PagedKVCache
from dsv4.runner.sampler import Sampler
from dsv4.runner.step_forward import StepForward, sampling_spec
from dsv4.scheduler.batch import RequestStepOutput, ScheduledBatch, StepOutput
from dsv4.speculative.metrics import SpecMetrics


class ModelRunner:
    """Owned by the `EngineCore` (engine thread)."""

    def __init__(self, forward: StepForward, sampler: Sampler, cache: PagedKVCache) -> None:
        """`cache`: the paged KV cache `forward` computes on (transports register its
        backing); `sampler`: the one `forward`'s speculative half samples with, if any."""
        self.forward = forward
        self.sampler = sampler
        self.cache = cache
        # share of ratio-4 layers whose top-k comes from the IndexCache (a worker metric)
        self.index_cache_hit_ratio = 0.0
        # per-layer expert popularity (a RoutingStats), None unless EngineOptions.routing_stats
        self.routing_stats = None

    @property
    def num_graph_replays(self) -> int:
        """Target-pass replays so far (0 without graphs): tells graph steps from eager ones."""
        return self.forward.num_graph_replays

    @property
    def spec_metrics(self) -> SpecMetrics | None:
        """Drafted / accepted counts per draft position (None without speculation)."""
        return self.forward.spec_metrics

    @torch.no_grad()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        for request_id in batch.finished_request_ids:
            self.sampler.release(request_id)
        result = self.forward.run(batch)
        emitted = dict(result.chosen)
        if result.logits is not None:
            params = {r.request_id: r.sampling_params for r in batch.requests}
            specs = [sampling_spec(params[rid]) for rid in result.sample_ids]
            tokens = self.sampler.sample(result.logits, list(result.sample_ids), specs)
            emitted.update((rid, (token,)) for rid, token in zip(result.sample_ids, tokens))
        return StepOutput(
            tuple(
                RequestStepOutput(r.request_id, emitted.get(r.request_id, ()))
                for r in batch.requests
            )
        )
