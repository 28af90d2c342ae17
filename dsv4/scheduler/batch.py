"""What crosses the scheduler / runner boundary each step (frozen, engine thread only).

`Scheduler.schedule()` -> `ScheduledBatch` -> runner executes -> `StepOutput` ->
`Scheduler.update()` -> `RequestOutput`s for the engine to stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4.scheduler.request import FinishCause
from dsv4.types import PromptLogprobs, SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's work in a step. Decodes come first in `ScheduledBatch.requests`."""

    request_id: str
    token_ids: tuple[int, ...]  # tokens to compute this step (drafts not included)
    start_position: int  # position of token_ids[0] (= tokens already in the cache)
    is_prefill: bool
    num_draft_tokens: int  # speculative positions the runner appends after token_ids
    samples_token: bool  # a token is sampled (decode, or the last chunk of a prefill)
    block_table: tuple[int, ...]  # token block ids (see dsv4.cache.layout)
    ring_block_ids: tuple[int, ...]
    sampling_params: SamplingParams | None = None  # None: greedy
    # (prompt ids, output ids so far) of a request that samples with penalties, else None: the
    # request's own prompt tuple and a snapshot of its outputs (~1 us per 1K tokens); the
    # sampler's `PenaltyState` reads only the outputs it has not counted yet
    token_history: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    # `SamplingParams.prompt_logprobs`: the prompt tokens this chunk's rows predict (row i, at
    # position start + i, predicts the token at start + i + 1 while that is a prompt token:
    # the last row of a chunk predicts the next chunk's first token, the prompt's last row the
    # first generated one, which is not among them); () when not asked or already sent
    prompt_logprob_targets: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_position(self) -> int:
        """One past the last position computed (drafts not included)."""
        return self.start_position + len(self.token_ids)


@dataclass(frozen=True)
class PrefillChunk:
    """Consecutive prefill requests `[start, end)` (indices into `ScheduledBatch.prefills`)
    whose attention runs as one launch over a workspace of `num_rows * width_rows` rows."""

    start: int
    end: int
    max_compressed_len: int  # N: workspace rows for compressed entries
    max_gather_len: int  # window prefix + query rows after them

    @property
    def num_requests(self) -> int:
        return self.end - self.start

    @property
    def width_rows(self) -> int:
        """M = N + max gather length: workspace rows per request."""
        return self.max_compressed_len + self.max_gather_len

    @property
    def area_rows(self) -> int:
        return self.num_requests * self.width_rows


@dataclass(frozen=True)
class ChunkPlan:
    """The prefill attention chunks for the layers of one compress ratio (0, 4 or 128)."""

    ratio: int
    chunks: tuple[PrefillChunk, ...]


@dataclass(frozen=True)
class ScheduledBatch:
    requests: tuple[ScheduledRequest, ...]  # decodes first, then prefills
    chunk_plans: tuple[ChunkPlan, ...] = ()
    preempted_request_ids: tuple[str, ...] = ()  # blocks freed this step (recompute later)
    # Requests that left the scheduler since the last batch (finished or aborted): the runner
    # drops any per-request state it keeps for them.
    finished_request_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens the step computes, draft positions included."""
        return sum(r.num_tokens + r.num_draft_tokens for r in self.requests)

    @property
    def prefills(self) -> tuple[ScheduledRequest, ...]:
        return tuple(r for r in self.requests if r.is_prefill)

    @property
    def decodes(self) -> tuple[ScheduledRequest, ...]:
        return tuple(r for r in self.requests if not r.is_prefill)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    def chunk_plan(self, ratio: int) -> ChunkPlan:
        for plan in self.chunk_plans:
            if plan.ratio == ratio:
                return plan
        raise KeyError(f"no chunk plan for ratio {ratio}")


@dataclass(frozen=True)
class RequestStepOutput:
    """The runner's result for one scheduled request. `new_token_ids`: nothing for a
    prefill chunk that does not sample, else the sampled token, or for a decode with drafts
    the accepted draft tokens followed by the bonus token (1 + accepted). `logprobs`: one per
    new token when the request asked (`SamplingParams.logprobs`), else (). `prompt_logprobs`:
    one per `ScheduledRequest.prompt_logprob_targets` entry, in order."""

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True)
class StepOutput:
    outputs: tuple[RequestStepOutput, ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """What `Scheduler.update` reports per request: tokens to stream (with their logprobs when
    the request asked) and how it ended; with the first token, the prompt's logprobs when the
    request asked (`SamplingParams.prompt_logprobs`)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishCause | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per new token id, or () when not asked
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
