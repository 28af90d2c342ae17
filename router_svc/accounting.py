"""Usage of one request as the router sees it, and the stream chunks that carry it.

TTFT is measured from the router receiving the request to the router handing the first token
to gRPC. Prefill timings come from P; transfer bytes and time, recompute and speculative counts
from D's last message (summed over attempts when a request migrated). Event loop only.
"""

from __future__ import annotations

import dataclasses
import time

from dsv4.types import FinishReason, PrefillResult, StreamChunk, Usage
from router_svc.output import OutputStep, OutputTracker


class RequestAccount:
    def __init__(
        self, num_prompt_tokens: int, tracker: OutputTracker, received_at_s: float
    ) -> None:
        self._num_prompt_tokens = num_prompt_tokens
        self._tracker = tracker
        self._received_at_s = received_at_s
        self._ttft_ms: float | None = None
        self._prefill = Usage()
        self._decodes: list[Usage] = []
        self._decode_worker_id = ""
        self.num_prefill_retries = 0

    def on_prefill(self, result: PrefillResult, worker_id: str) -> None:
        self._prefill = Usage(
            prefill_worker_id=result.handle.prefill_worker_id or worker_id,
            prefill_queue_ms=result.timings.queue_ms,
            prefill_compute_ms=result.timings.compute_ms,
        )

    def on_decode_started(self, worker_id: str) -> None:
        self._decode_worker_id = worker_id

    def on_decode_finished(self, usage: Usage | None) -> None:
        self._decodes.append(usage or Usage())

    def chunk(self, step: OutputStep, finish_reason: FinishReason | None = None) -> StreamChunk:
        """The chunk for `step`; with a finish reason it is the last one (text flushed, usage)."""
        if self._ttft_ms is None and step.token_ids:
            self._ttft_ms = (time.monotonic() - self._received_at_s) * 1000.0
        if finish_reason is None:
            return StreamChunk(step.token_ids, step.text, logprobs=step.logprobs,
                               prompt_logprobs=step.prompt_logprobs)  # fmt: skip
        return StreamChunk(
            token_ids=step.token_ids,
            text=step.text + self._tracker.flush(),
            finish_reason=finish_reason,
            usage=self.usage(),
            logprobs=step.logprobs,
            prompt_logprobs=step.prompt_logprobs,
        )

    def usage(self) -> Usage:
        d = self._decodes
        return dataclasses.replace(
            self._prefill,
            prompt_tokens=self._num_prompt_tokens,
            completion_tokens=self._tracker.num_tokens,
            time_to_first_token_ms=self._ttft_ms or 0.0,
            decode_worker_id=(d[-1].decode_worker_id if d else "") or self._decode_worker_id,
            kv_transfer_bytes=sum(u.kv_transfer_bytes for u in d),
            kv_transfer_ms=sum(u.kv_transfer_ms for u in d),
            num_prefill_retries=self.num_prefill_retries,
            prefill_was_recomputed=any(u.prefill_was_recomputed for u in d),
            num_draft_tokens=sum(u.num_draft_tokens for u in d),
            num_accepted_draft_tokens=sum(u.num_accepted_draft_tokens for u in d),
        )
