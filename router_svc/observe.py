"""Per-request observation on the router: latency histograms, token and status counters, and
the per-request log lines (with the request id bound by the servicer).

`StreamObserver` is created by the servicer for each Generate call, fed every chunk it writes
(`on_chunk`) and closed with the call's final status code (`finish`). Definitions match
`dsv4 loadtest`: TTFT = received -> first token written; ITL = gap between messages carrying
tokens; E2E = received -> last message; TPOT = (E2E - TTFT) / (tokens - 1). TPOT and E2E are
recorded for successful requests only (a failed request has no meaningful end-to-end time).
`vllm:request_success_total{finished_reason}` counts a successful call by its last chunk's
finish reason (stop, length, abort) and a call whose client went away (CANCELLED) as abort, as
vLLM counts an aborted request; calls that failed with another status are not counted.
Event loop only.
"""

from __future__ import annotations

import logging
import time

from dsv4.serving.metrics import RouterMetrics
from dsv4.types import FinishReason, StreamChunk

logger = logging.getLogger(__name__)


class StreamObserver:
    def __init__(self, metrics: RouterMetrics, received_at_s: float) -> None:
        self._metrics = metrics
        self._received_at_s = received_at_s
        self._first_token_at_s: float | None = None
        self._last_token_at_s = 0.0
        self.num_tokens = 0
        self.finish_reason: FinishReason | None = None

    def on_chunk(self, chunk: StreamChunk) -> None:
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        if not chunk.token_ids:
            return
        now_s = time.monotonic()
        if self._first_token_at_s is None:
            self._first_token_at_s = now_s
            self._metrics.ttft.observe(now_s - self._received_at_s)
        else:
            self._metrics.itl.observe(now_s - self._last_token_at_s)
        self._last_token_at_s = now_s
        self.num_tokens += len(chunk.token_ids)
        self._metrics.generation_tokens.inc(len(chunk.token_ids))

    def finish(self, code: str, details: str = "") -> None:
        """Record the request's end; `code` is a grpc.StatusCode name ("OK" on success)."""
        m = self._metrics
        m.requests.labels(method="Generate", code=code).inc()
        if code == "OK" and self.finish_reason is not None:
            m.request_success[self.finish_reason.value].inc()
        elif code == "CANCELLED":  # the client went away: vLLM's abort
            m.request_success[FinishReason.ABORT.value].inc()
        e2e_s = time.monotonic() - self._received_at_s
        if code == "OK":
            m.e2e.observe(e2e_s)
            if self._first_token_at_s is not None and self.num_tokens > 1:
                ttft_s = self._first_token_at_s - self._received_at_s
                m.tpot.observe((e2e_s - ttft_s) / (self.num_tokens - 1))
            logger.info("finished OK: %d tokens in %.3f s", self.num_tokens, e2e_s)
        else:
            logger.info(
                "finished %s after %d tokens in %.3f s: %s", code, self.num_tokens, e2e_s, details
            )
