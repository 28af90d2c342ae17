"""The client seam: what the runner needs from a streaming server, and what it gets back.

`StreamingClient` is the only thing the runner calls. Implementations: `loadgen.grpc_client`
(`dsv4.v1.Router`, the only module that touches generated stubs) and `loadgen.openai_client`
(any OpenAI-compatible HTTP server); `make_client` picks one by backend; tests plug in fakes.

Timestamps are `time.perf_counter()` seconds. A streamed message may carry several tokens
(speculative decoding / MTP), so a record keeps one arrival time per message plus the number
of tokens that message carried, not one time per token. A `TokenListener` (the live progress
bar) hears about every message as it arrives, not only about finished requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from dsv4.types import Usage
from loadgen.workloads import LoadRequest

STATUS_OK = "OK"
# Pseudo status codes for failures that have no gRPC status of their own.
STATUS_EMPTY_RESPONSE = "EMPTY_RESPONSE"  # stream ended OK but carried no tokens
STATUS_CLIENT_ERROR = "CLIENT_ERROR"  # exception inside the client, not from the server
BACKENDS = ("grpc", "openai", "openai-chat")  # vLLM's names for the two HTTP ones
BACKEND_ALIASES = {"vllm": "openai"}  # `vllm bench serve --backend vllm` = OpenAI completions


@dataclass(frozen=True)
class ClientOptions:
    """How to reach and call the server. `target` is HOST:PORT; `url` is the full endpoint URL
    of the HTTP backends ("" for gRPC) and `models_url` their /v1/models; `model` is the name sent in OpenAI requests ("": ask
    the server's /v1/models)."""

    target: str
    backend: str = "grpc"
    url: str = ""
    models_url: str = ""
    model: str = ""
    timeout_s: float | None = None
    tls_ca_path: str | None = None
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float | None = None
    tokenizer_path: str | None = None  # chat prompts from token-id workloads are decoded by it


@dataclass(frozen=True)
class ModelInfoView:
    """What loadgen learns about the served model (`dsv4.v1.ModelInfo` or `/v1/models`);
    0 / "" where the server does not say."""

    model_name: str
    vocab_size: int
    max_model_len: int
    speculative_method: str = ""


@dataclass(frozen=True)
class RequestRecord:
    """Everything measured for one request. `status_code` is a gRPC status code name
    (`OK`, `RESOURCE_EXHAUSTED`, ...), `HTTP_<code>` for an HTTP error, or a pseudo code."""

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
    usage: Usage | None = None

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


class TokenListener(Protocol):
    """Hears every token-carrying message while streams run (event loop only)."""

    def on_tokens(self, start_s: float, prev_s: float | None, now_s: float, num: int) -> None:
        """`num` tokens arrived at `now_s` for a request sent at `start_s` whose previous
        message arrived at `prev_s` (None: these are its first tokens)."""
        ...


class StreamingClient(Protocol):
    """A server that streams tokens for one request at a time (many concurrently)."""

    async def generate(
        self, request: LoadRequest, listener: TokenListener | None = None
    ) -> RequestRecord:
        """Send `request`, consume its whole stream, and return the measurements.

        Called by the runner from its event loop, once per request, many in flight at once.
        Must never raise for server-side or network failures: those come back as a record
        with a non-OK `status_code` and an `error` message. Cancellation may propagate.
        """
        ...


class RecordBuilder:
    """Collects timestamps while a stream is consumed; `build()` freezes them into a record."""

    def __init__(self, request: LoadRequest, listener: TokenListener | None = None) -> None:
        self.request = request
        self.listener = listener
        self.start_s = time.perf_counter()
        self.chunk_times_s: list[float] = []
        self.chunk_num_tokens: list[int] = []
        self.finish_reason = ""
        self.usage: Usage | None = None

    def on_message(self, num_tokens: int) -> None:
        """Record one streamed message; messages without tokens (usage-only) are ignored."""
        if num_tokens > 0:
            now_s = time.perf_counter()
            if self.listener is not None:
                prev_s = self.chunk_times_s[-1] if self.chunk_times_s else None
                self.listener.on_tokens(self.start_s, prev_s, now_s, num_tokens)
            self.chunk_times_s.append(now_s)
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


def make_client(options: ClientOptions) -> Any:
    """The `StreamingClient` for `options.backend`; create it inside the running event loop."""
    if options.backend == "grpc":
        from loadgen.grpc_client import GrpcRouterClient

        return GrpcRouterClient(options)
    from loadgen.openai_client import OpenAIClient

    return OpenAIClient(options)
