"""The one interface between `ModelRunner` and a forward: `StepForward.run(batch) -> StepResult`.

Two implementations, each with its own MTP speculative half:
- `dsv4.runner.reference.ReferenceForward`: the model over per-request states loaded from the
  paged cache and stored back (the oracle every fast path is tested against);
- `dsv4.runner.paged.PagedStepForward`: every step as one flat forward on the cache through the
  kernels, decode-only steps replayed from captured graphs (the GPU serving path).

A forward leaves the runner the logits to sample (one row per sampling request). With
speculation on, verification has to sample (rejection sampling draws from each request's
generator), so a speculative half chooses its requests' tokens itself and returns them as
`chosen`; the runner samples the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dsv4.errors import ConfigError
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.ops.sampling import SamplingSpec
from dsv4.runner.kv_cache import PagedKVCache
from dsv4.runner.prompt_logprobs import StepPromptLogprobs
from dsv4.scheduler.batch import ScheduledBatch
from dsv4.speculative.metrics import SpecMetrics
from dsv4.types import SamplingParams


@dataclass(frozen=True)
class StepResult:
    """What a forward leaves for sampling.

    `logits` [len(sample_ids), V] fp32: row i belongs to request `sample_ids[i]` (requests in
    batch order); None when there is nothing to sample. `chosen`: tokens a speculative half
    already chose (accepted drafts + 1 per verified decode, a sampled token otherwise).
    `greedy` [B] int64 (device): an all-greedy graph step's tokens, one per request in batch
    order, taken by the graph itself (`features.greedy_in_graph`); not yet on the host.
    `prompt_logprobs`: the prefill chunks' that asked, on the device (None: none asked)."""

    logits: torch.Tensor | None = None
    sample_ids: tuple[str, ...] = ()
    chosen: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    greedy: torch.Tensor | None = None
    prompt_logprobs: StepPromptLogprobs | None = None


class StepForward(Protocol):
    """Owned by the `ModelRunner` (engine thread)."""

    def run(self, batch: ScheduledBatch) -> StepResult:
        """Compute the batch on the paged cache (the cache carries every request between
        steps) and drop what the forward keeps for `batch`'s finished / preempted requests."""
        ...

    @property
    def spec_metrics(self) -> SpecMetrics | None:
        """Drafted / accepted counts per draft position (None without speculation)."""
        ...

    @property
    def num_graph_replays(self) -> int:
        """Captured target passes replayed so far (0 without graphs): tells graph steps from
        eager ones."""
        ...


def sampling_spec(params: SamplingParams | None) -> SamplingSpec:
    """The sampler's view of a request's sampling parameters (None: greedy)."""
    if params is None:
        return SamplingSpec()
    return SamplingSpec(
        temperature=float(params.temperature or 0.0),
        top_p=float(params.top_p or 1.0),
        top_k=int(params.top_k or 0),
        seed=params.seed,
        presence_penalty=float(params.presence_penalty),
        frequency_penalty=float(params.frequency_penalty),
        repetition_penalty=float(params.repetition_penalty),
        logit_bias=params.logit_bias,
        logprobs=params.logprobs,
    )


def check_speculation(model: DeepseekV4, cache: PagedKVCache, requested: int | None) -> int:
    """The MTP draft count k a forward runs with: `requested`, by default the layout's draft
    slots; k > 0 needs the model's MTP layer."""
    k = cache.layout.options.num_speculative_tokens if requested is None else requested
    if k and not len(model.mtp):
        raise ConfigError("num_speculative_tokens", k, "the model has no MTP layer; use 0")
    return k
