"""`StreamingClient` over HTTP to any OpenAI-compatible server (vLLM, SGLang, this project's
HTTP front): `/v1/completions` (backend `openai`) or `/v1/chat/completions` (`openai-chat`),
streamed as server-sent events, with aiohttp; one `ClientSession` serves every request.

Each request asks for `stream_options.include_usage`, so the last event carries the server's
token counts. As in `vllm bench serve`, every `data:` event whose choice carries text
(completions: `text`; chat: `delta.content` or `delta.reasoning_content`) is one message of one
token. When the server's usage counts more tokens than events (a server that sends several
tokens per event), the last message takes the difference, so totals and TPOT use the server's
count. HTTP errors are `HTTP_<status>` with the OpenAI error object's message.

Prompts: completions get the token ids themselves (exact lengths). Chat needs text: text
workloads as they are; token-id workloads decoded with `--tokenizer`, else a synthetic text of
one short word per token (the server's `usage.prompt_tokens` then gives the true length).
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from typing import Any

from dsv4.types import Usage
from loadgen.client import (
    STATUS_CLIENT_ERROR,
    ClientOptions,
    ModelInfoView,
    RecordBuilder,
    RequestRecord,
    TokenListener,
)
from loadgen.target import (
    REACH_TIMEOUT_S,
    LoadtestConfigError,
    TargetUnreachable,
    check_tcp_reachable,
    not_http_message,
    sniff_protocol,
    unreachable_message,
)
from loadgen.workloads import LoadRequest

READ_BUFSIZE = 1 << 20  # one SSE line may hold a long event


def synthetic_text(token_ids: tuple[int, ...]) -> str:
    """One two-letter word per token id: deterministic text of about that many tokens."""
    return " ".join(chr(97 + t % 26) + chr(97 + t // 26 % 26) for t in token_ids)


async def sse_data(lines: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The payloads of `data:` lines (comments, `event:` and blank lines skipped)."""
    async for raw in lines:
        line = raw.decode("utf-8").strip()
        if line.startswith("data:"):
            yield line[5:].lstrip()


class StreamError(Exception):
    """An error object inside an otherwise OK event stream."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


def _error_status(error: Any) -> tuple[str, str]:
    """(status code name, message) of an OpenAI error object (or anything else)."""
    if not isinstance(error, dict):
        return "STREAM_ERROR", str(error)
    code = error.get("code")
    status = f"HTTP_{code}" if isinstance(code, int) else "STREAM_ERROR"
    return status, str(error.get("message") or error)


class OpenAIClient:
    """Async client; create it inside the running event loop, `await close()` when done."""

    def __init__(self, options: ClientOptions) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self.options = options
        self.model = options.model
        self.is_chat = options.backend == "openai-chat"
        context = ssl.create_default_context(cafile=options.tls_ca_path or None)
        headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ssl=context),
            timeout=aiohttp.ClientTimeout(total=options.timeout_s),
            headers=headers,
            read_bufsize=READ_BUFSIZE,
        )
        self._tokenizer = None
        if self.is_chat and options.tokenizer_path:
            from loadgen.datasets import load_tokenizer

            self._tokenizer = load_tokenizer(options.tokenizer_path)

    async def close(self) -> None:
        await self._session.close()

    async def check_reachable(self) -> None:
        """Raise TargetUnreachable unless something accepts TCP connections at the target."""
        await check_tcp_reachable(self.options.target)

    async def fetch_model_info(self) -> ModelInfoView | None:
        """The --model entry of /v1/models, else its first model (as `vllm bench serve`
        picks); None when the server has no such list. Without --model, requests then name
        the model found here. Raises LoadtestConfigError when the target speaks gRPC."""
        try:
            timeout = self._aiohttp.ClientTimeout(total=REACH_TIMEOUT_S)
            async with self._session.get(self.options.models_url, timeout=timeout) as response:
                listing = await response.json(content_type=None) if response.status == 200 else {}
        except TimeoutError:  # before ClientError: a timeout is one of those too
            if self.model:  # requests name --model: the run itself tells what the server does
                return None
            # else the line would read "lists no model", which it never said: it did not answer
            reason = (
                f"accepted a connection but did not answer GET /v1/models in {REACH_TIMEOUT_S:g} s"
            )
            raise TargetUnreachable(unreachable_message(self.options.target, reason)) from None
        except ValueError:  # an answer that is not JSON: no listing to read
            return None
        except self._aiohttp.ClientError:
            if await sniff_protocol(self.options.target) == "http2":  # a gRPC port
                raise LoadtestConfigError(not_http_message(self.options.target)) from None
            return None
        models = listing.get("data") if isinstance(listing, dict) else None
        listed = [m for m in models or () if isinstance(m, dict) and m.get("id")]
        chosen = next((m for m in listed if m["id"] == self.model), listed[0] if listed else None)
        if chosen is None:
            return None
        self.model = self.model or str(chosen["id"])
        vocab_size = int(chosen.get("vocab_size") or 0)  # dsv4's /v1/models lists it; vLLM's not
        return ModelInfoView(str(chosen["id"]), vocab_size, int(chosen.get("max_model_len") or 0))

    def prompt_text(self, request: LoadRequest) -> str:
        if request.prompt_text is not None:
            return request.prompt_text
        ids = request.prompt_token_ids or ()
        if self._tokenizer is not None:
            return self._tokenizer.decode(list(ids), skip_special_tokens=True)
        return synthetic_text(ids)

    def build_body(self, request: LoadRequest) -> dict[str, Any]:
        """The JSON body: exactly `output_len` new tokens (with `ignore_eos`), streamed."""
        body: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.is_chat:
            body["messages"] = [{"role": "user", "content": self.prompt_text(request)}]
            body["max_completion_tokens"] = request.output_len
        else:
            ids = request.prompt_token_ids
            body["prompt"] = list(ids) if ids is not None else request.prompt_text
            body["max_tokens"] = request.output_len
        if self.options.ignore_eos:
            body["ignore_eos"] = True  # vLLM's / SGLang's extension
        if self.options.temperature is not None:
            body["temperature"] = self.options.temperature
        return body

    async def generate(
        self, request: LoadRequest, listener: TokenListener | None = None
    ) -> RequestRecord:
        """Stream one request; HTTP and network errors become a record, never raise."""
        try:
            body = self.build_body(request)
        except Exception as exc:  # e.g. a tokenizer that cannot decode the ids
            return RecordBuilder(request).build(STATUS_CLIENT_ERROR, f"bad request: {exc}")
        aiohttp = self._aiohttp
        builder = RecordBuilder(request, listener)
        try:
            async with self._session.post(self.options.url, json=body) as response:
                if response.status != 200:
                    message = _error_status(await _error_object(response))[1]
                    return builder.build(f"HTTP_{response.status}", message)
                async for data in sse_data(response.content):
                    if data == "[DONE]":
                        break
                    self._on_event(builder, json.loads(data))
        except StreamError as exc:
            return builder.build(exc.status, str(exc))
        except TimeoutError:
            timeout_s = self.options.timeout_s
            return builder.build("DEADLINE_EXCEEDED", f"no end of stream in {timeout_s} s")
        except aiohttp.ClientError as exc:
            return builder.build("UNAVAILABLE", f"{type(exc).__name__}: {exc}")
        except ValueError as exc:  # an event that is not JSON
            return builder.build(STATUS_CLIENT_ERROR, f"bad event: {exc}")
        usage = builder.usage
        if usage is not None and builder.chunk_num_tokens:
            missing = usage.completion_tokens - sum(builder.chunk_num_tokens)
            if missing > 0:  # several tokens per event: the server's count wins
                builder.chunk_num_tokens[-1] += missing
        return builder.build()

    def _on_event(self, builder: RecordBuilder, event: Any) -> None:
        if not isinstance(event, dict):
            raise ValueError(f"event is not an object: {event!r:.80}")
        if "error" in event:
            raise StreamError(*_error_status(event["error"]))
        choices = event.get("choices") or []
        if choices:
            choice = choices[0]
            if self.is_chat:
                delta = choice.get("delta") or {}
                text = delta.get("content") or delta.get("reasoning_content")
            else:
                text = choice.get("text")
            if text:
                builder.on_message(1)
            if choice.get("finish_reason"):
                builder.finish_reason = str(choice["finish_reason"])
        usage = event.get("usage")
        if isinstance(usage, dict):
            builder.usage = Usage(
                prompt_tokens=int(usage.get("prompt_tokens") or 0),
                completion_tokens=int(usage.get("completion_tokens") or 0),
            )


async def _error_object(response: Any) -> Any:
    """The `error` of an OpenAI error body, else the body's text (cut short)."""
    text = await response.text()
    try:
        return json.loads(text).get("error", text)
    except (ValueError, AttributeError):
        return text[:200]
