"""The paged forward as a `StepForward`: one flat forward per step on the cache, through the kernels.

Decode-only steps replay the captured passes of `DecodeGraphs` when given (and when the step
fits a bucket), every other step runs `PagedForward` eagerly. With MTP speculation on, steps go
to this forward's speculative half, `speculative.PagedSpeculator` (verify the drafts the
previous step proposed, accept, propose the next ones with the MTP layer on the cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4.runner.paged.decode_graphs import DecodeGraphs, GraphOptions
from dsv4.runner.paged.forward import (
    DEFAULT_METADATA,
    DEFAULT_SWITCHES,
    PagedForward,
    PagedOutput,
)
from dsv4.runner.paged.forward_state import PagedSwitches
from dsv4.runner.paged.speculative import PagedSpeculator
from dsv4.runner.paged.step_metadata import MetadataSwitches
from dsv4.runner.prompt_logprobs import StepPromptLogprobs
from dsv4.runner.sampler import Sampler
from dsv4.runner.step_forward import StepResult, check_speculation, sampling_spec
from dsv4.scheduler.batch import ScheduledBatch
from dsv4.speculative.metrics import SpecMetrics


@dataclass(frozen=True)
class PagedOptions:
    """The paged forward's switches; `graphs`: capture the decode step's passes (or run them
    as static eager steps: `GraphOptions.capture` False), None for eager decode steps."""

    metadata: MetadataSwitches = DEFAULT_METADATA
    switches: PagedSwitches = DEFAULT_SWITCHES
    graphs: GraphOptions | None = None


class PagedStepForward:
    """A `StepForward`; owned by the `ModelRunner` (engine thread)."""

    def __init__(
        self,
        paged: PagedForward,
        sampler: Sampler,
        graphs: DecodeGraphs | None = None,
        *,
        num_speculative_tokens: int | None = None,
    ) -> None:
        """`num_speculative_tokens` (default: the layout's draft slots) > 0 turns MTP on; the
        speculative half samples with `sampler` (rejection sampling, draft choices)."""
        self.paged, self.graphs = paged, graphs
        # all-greedy graph steps take the in-graph argmax (features.greedy_in_graph); the
        # benchmark flips it on the same graphs for its A/B
        self.greedy_in_graph = graphs is not None and graphs.greedy_argmax
        self.num_greedy_in_graph = 0  # steps whose tokens the graph chose (tests, metrics)
        k = check_speculation(paged.model, paged.cache, num_speculative_tokens)
        self.spec = PagedSpeculator(paged, sampler, k, graphs) if k else None

    @property
    def spec_metrics(self) -> SpecMetrics | None:
        return None if self.spec is None else self.spec.metrics

    @property
    def num_graph_replays(self) -> int:
        return 0 if self.graphs is None else self.graphs.passes["target"].num_runs

    def run(self, batch: ScheduledBatch) -> StepResult:
        result = self._run(batch)
        self._after_step()
        return result

    def check_step(self) -> None:
        """Once the step's output is on the host: raise if the expert pool could not place
        its experts (`ExpertPool.check`), so no token of a bad step is served."""
        if self.paged.expert_pool is not None:  # MTP steps mirror after their own sync
            self.paged.expert_pool.check(sync=self.spec is not None)

    def _after_step(self) -> None:
        if self.paged.expert_pool is not None:  # its counters to the host, behind the step
            self.paged.expert_pool.mirror()

    def _run(self, batch: ScheduledBatch) -> StepResult:
        if self.spec is not None:
            for request_id in (*batch.finished_request_ids, *batch.preempted_request_ids):
                self.spec.release(request_id)
        if not batch.requests:
            return StepResult()
        if self.spec is not None:
            specs = {r.request_id: sampling_spec(r.sampling_params) for r in batch.requests}
            return StepResult(chosen=self.spec.step(batch, specs))
        out = None
        if self.graphs is not None and not batch.prefills:
            out = self.graphs.run_target(batch.requests, {})  # (logits [B, V], streams[, ids])
        if out is not None and self.greedy_in_graph and _all_greedy(batch):
            tokens = self.graphs.target_tokens(out)
            if tokens is not None:  # the runner copies back [B] int64: no sampler launch
                self.num_greedy_in_graph += 1
                return StepResult(greedy=tokens)
        sample_ids = tuple(r.request_id for r in batch.requests if r.samples_token)
        if out is not None:  # decode-only: no prefill chunk, no prompt logprobs
            return StepResult(out[0], sample_ids)  # [sampling, V]
        eager = self.paged(batch)
        return StepResult(eager.logits, sample_ids, prompt_logprobs=self._prompt(batch, eager))

    def _prompt(self, batch: ScheduledBatch, eager: PagedOutput) -> StepPromptLogprobs | None:
        """The prompt logprobs of the step's chunks that asked, from their rows of the final
        streams [T, M, D]; None (nothing done) when none asked."""
        prompt = StepPromptLogprobs.of(batch, self.paged.head_logits)
        if prompt is not None:
            for request, first in zip(batch.requests, eager.tokens.first_token):
                prompt.add(request, eager.streams[first : first + request.num_tokens])
        return prompt

    def run_ahead(self, batch: ScheduledBatch, previous: torch.Tensor,
                  prev_rows: Sequence[int]) -> StepResult | None:  # fmt: skip
        """Async scheduling: an all-greedy decode-only step whose tokens are the previous
        step's greedy tokens `previous` [B'] (device; request i's at `prev_rows[i]`), fed on
        the device, never read on the host. None (nothing ran): the step needs the tokens on
        the host (no graph bucket, speculation, sampling rows)."""
        if (self.spec is not None or self.graphs is None or not self.greedy_in_graph
                or batch.prefills or not batch.requests or not _all_greedy(batch)):  # fmt: skip
            return None
        out = self.graphs.run_target(batch.requests, {}, (previous, prev_rows))
        if out is None:
            return None
        self._after_step()
        self.num_greedy_in_graph += 1
        return StepResult(greedy=self.graphs.target_tokens(out))


def _all_greedy(batch: ScheduledBatch) -> bool:
    """Every request takes the sampler's greedy path (temperature 0: `SamplingSpec.is_greedy`)
    on logits as they are and needs no more of them (penalties and a logit bias shift them
    first, logprobs are read from them: the sampler's)."""
    specs = [sampling_spec(r.sampling_params) for r in batch.requests]
    return all(s.is_greedy and not s.needs_logits_processing for s in specs)
