"""The client seam: what the runner needs from a streaming server, and what it gets back.

`StreamingClient` is the only thing the runner calls. The gRPC implementation lives in
`loadgen.grpc_client` and is the only module that touches generated stubs; tests plug in fakes.

Timestamps are `time.perf_counter()` seconds. A streamed message may carry several tokens
(speculative decoding / MTP), so a record keeps one arrival time per message plus the number
of tokens that message carried, not one time per token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from loadgen.workloads import LoadRequest

STATUS_OK = "OK"
# Pseudo status codes for failures that have no gRPC status of their own.
STATUS_EMPTY_RESPONSE = "EMPTY_RESPONSE"  # stream ended OK but carried no tokens
STATUS_CLIENT_ERROR = "CLIENT_ERROR"  # exception inside the client, not from the server


@dataclass(frozen=True)
class ServerUsage:
    """What the server said about the request on its last message (`dsv4.v1.Usage`)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    time_to_first_token_ms: float = 0.0
    prefill_worker_id: str = ""
    decode_worker_id: str = ""
    kv_transfer_ms: float = 0.0
    prefill_queue_ms: float = 0.0
    prefill_compute_ms: float = 0.0
    num_prefill_retries: int = 0
    prefill_was_recomputed: bool = False
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0


@dataclass(frozen=True)
class RequestRecord:
    """Everything measured for one request. `status_code` is a gRPC status code name
    (`OK`, `RESOURCE_EXHAUSTED`, ...) or one of the pseudo codes above."""

    request_id: str
    input_len: int
    requested_output_len: int
    start_s: float
    end_s: float
    chunk_times_s: tuple[float, ...] = ()
    chunk_num_tokens: tuple[int, ...] = ()
    status_code: str = STATUS_OK
    error: str = ""
    finish_reason: str = ""
    scheduled_s: float | None = None
    usage: ServerUsage | None = None

    @property
    def is_success(self) -> bool:
        return self.status_code == STATUS_OK

    @property
    def num_output_tokens(self) -> int:
        return sum(self.chunk_num_tokens)

    @property
    def num_input_tokens(self) -> int:
        """The server's count when it reported one, else the client's."""
        if self.usage is not None and self.usage.prompt_tokens > 0:
            return self.usage.prompt_tokens
        return self.input_len


class StreamingClient(Protocol):
    """A server that streams tokens for one request at a time (many concurrently)."""

    async def generate(self, request: LoadRequest) -> RequestRecord:
        """Send `request`, consume its whole stream, and return the measurements.

        Called by the runner from its event loop, once per request, many in flight at once.
        Must never raise for server-side or network failures: those come back as a record
        with a non-OK `status_code` and an `error` message. Cancellation may propagate.
        """
        ...


class RecordBuilder:
    """Collects timestamps while a stream is consumed; `build()` freezes them into a record."""

    def __init__(self, request: LoadRequest) -> None:
        self.request = request
        self.start_s = time.perf_counter()
        self.chunk_times_s: list[float] = []
        self.chunk_num_tokens: list[int] = []
        self.finish_reason = ""
        self.usage: ServerUsage | None = None

    def on_message(self, num_tokens: int) -> None:
        """Record one streamed message; messages without tokens (usage-only) are ignored."""
        if num_tokens > 0:
            self.chunk_times_s.append(time.perf_counter())
            self.chunk_num_tokens.append(num_tokens)

    def build(self, status_code: str = STATUS_OK, error: str = "") -> RequestRecord:
        """Freeze. An OK stream that carried no tokens becomes EMPTY_RESPONSE."""
        if status_code == STATUS_OK and not self.chunk_num_tokens:
            status_code, error = STATUS_EMPTY_RESPONSE, error or "stream ended with no tokens"
        return RequestRecord(
            request_id=self.request.request_id,
            input_len=self.request.input_len,
            requested_output_len=self.request.output_len,
            start_s=self.start_s,
            end_s=time.perf_counter(),
            chunk_times_s=tuple(self.chunk_times_s),
            chunk_num_tokens=tuple(self.chunk_num_tokens),
            status_code=status_code,
            error=error,
            finish_reason=self.finish_reason,
            usage=self.usage,
        )
