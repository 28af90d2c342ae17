"""A request's mutable state inside the scheduler (engine thread only).

Token accounting: `all_token_ids = prompt + outputs`; the first `num_computed_tokens` of them
have KV in the cache. A request is decoding when only its newest sampled token is left to
compute; anything more (the prompt, or prompt + outputs after a preemption by recompute) is
prefill work.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from dsv4.types import FinishReason, SamplingParams, TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; waits to be recomputed from its tokens so far
    FINISHED = "finished"


class FinishCause(enum.Enum):
    """Why the scheduler finished a request: finer than what a stream reports
    (`dsv4.types.FinishReason`, which `reason` maps it to)."""

    EOS = "eos"
    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"  # decided by the caller's detokenizer (`StopChecker`)
    LENGTH = "length"
    ABORTED = "aborted"

    @property
    def reason(self) -> FinishReason:
        """What the stream's last chunk says."""
        return _STREAM_REASON[self]


_STREAM_REASON = {
    FinishCause.EOS: FinishReason.STOP,
    FinishCause.STOP_TOKEN: FinishReason.STOP,
    FinishCause.STOP_STRING: FinishReason.STOP,
    FinishCause.LENGTH: FinishReason.LENGTH,
    FinishCause.ABORTED: FinishReason.ABORT,
}


@dataclass(eq=False)
class Request:
    """Created by the engine from a validated client request; owned by the `Scheduler`.

    `sampling_params` (None: greedy) is the runner's to read; the scheduler reads only the
    stop fields below.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    sampling_params: SamplingParams | None = None
    eos_token_id: int | None = None  # None: ignore EOS
    stop_token_ids: frozenset[int] = frozenset()
    arrival_time_s: float = 0.0
    priority: int = 0  # lower value is served first
    arrival_seq: int = 0  # set by `Scheduler.add_request`: breaks ties of equal arrival times
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishCause | None = None
    num_preemptions: int = 0
    # `SamplingParams.prompt_logprobs` gathered chunk by chunk (positions 1.. in order) until
    # the first token is emitted with them
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_token_ids = tuple(self.prompt_token_ids)
        self.stop_token_ids = frozenset(self.stop_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return (
            self.num_computed_tokens >= self.num_prompt_tokens and self.num_uncomputed_tokens == 1
        )

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def prompt_logprob_targets(self, start: int, end: int) -> tuple[int, ...]:
        """The prompt tokens rows at positions [start, end) predict, for a request that asks
        prompt logprobs and has not sent them (no output yet): those at start + 1 .. while
        they are prompt tokens."""
        params = self.sampling_params
        if params is None or params.prompt_logprobs is None or self.output_token_ids:
            return ()
        return self.prompt_token_ids[start + 1 : min(end + 1, self.num_prompt_tokens)]

    def token_ids(self, start: int, end: int) -> tuple[int, ...]:
        """Tokens at positions [start, end) of prompt + outputs."""
        n_prompt = self.num_prompt_tokens
        head = self.prompt_token_ids[start:end] if start < n_prompt else ()
        tail = self.output_token_ids[max(0, start - n_prompt) : max(0, end - n_prompt)]
        return (*head, *tail)

    def append_output_tokens(
        self, token_ids: tuple[int, ...]
    ) -> tuple[tuple[int, ...], FinishCause | None]:
        """Append sampled tokens up to and including the first that ends the request; returns
        the tokens kept and why the request ended (None: it goes on)."""
        for count, token_id in enumerate(token_ids, start=1):
            self.output_token_ids.append(token_id)
            reason = self.stop_reason(token_id)
            if reason is not None:
                return token_ids[:count], reason
        return token_ids, None

    def stop_reason(self, token_id: int) -> FinishCause | None:
        """Why `token_id`, just appended, ends the request (None: it does not)."""
        if self.eos_token_id is not None and token_id == self.eos_token_id:
            return FinishCause.EOS
        if token_id in self.stop_token_ids:
            return FinishCause.STOP_TOKEN
        if len(self.output_token_ids) >= self.max_new_tokens:
            return FinishCause.LENGTH
        return None


class StopChecker(Protocol):
    def __call__(self, request: Request, new_token_ids: tuple[int, ...]) -> bool:
        """Called by `update` after appending tokens that hit no stop id: True ends the request
        with `FinishCause.STOP_STRING` (the caller's detokenizer matched a stop string)."""
        ...
