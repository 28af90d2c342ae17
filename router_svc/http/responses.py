"""OpenAI response objects for one request: whole (non-streaming) or as SSE chunks.

Completions are `text_completion` objects; chat answers are `chat.completion` (whole) and
`chat.completion.chunk` (streamed; the first delta carries `role: assistant`). A streamed
request that asked for `stream_options.include_usage` gets `"usage": null` on every chunk and
one last chunk with no choices and the usage, as OpenAI sends it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from dsv4.types import FinishReason, StreamChunk, Usage

FINISH_REASON = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
}
SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def usage_object(usage: Usage | None, num_tokens: int) -> dict[str, int]:
    prompt = usage.prompt_tokens if usage else 0
    completion = usage.completion_tokens if usage else num_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


@dataclass
class Reply:
    """The response to one request; feed it every chunk in order (`add`)."""

    is_chat: bool
    request_id: str
    model: str
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    usage: Usage | None = None

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.is_chat else 'cmpl'}-{self.request_id}"

    def add(self, chunk: StreamChunk) -> None:
        self.text.append(chunk.text)
        self.num_tokens += len(chunk.token_ids)
        if chunk.finish_reason is not None:
            self.finish_reason = FINISH_REASON[chunk.finish_reason]
            self.usage = chunk.usage

    def _object(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}  # fmt: skip

    def whole(self) -> dict[str, Any]:
        """The non-streaming answer, after the last chunk."""
        text = "".join(self.text)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": self.finish_reason}
        if self.is_chat:
            choice["message"] = {"role": "assistant", "content": text}
            kind = "chat.completion"
        else:
            choice["text"] = text
            kind = "text_completion"
        return {**self._object(kind, [choice]), "usage": usage_object(self.usage, self.num_tokens)}

    def stream_events(self, chunk: StreamChunk) -> list[bytes]:
        """`add(chunk)` and the SSE events it makes (none for an empty middle chunk)."""
        is_first = not self.text
        self.add(chunk)
        if not chunk.text and chunk.finish_reason is None and not (is_first and self.is_chat):
            return []
        reason = self.finish_reason if chunk.finish_reason is not None else None
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
        if self.is_chat:
            delta = {"role": "assistant"} if is_first else {}
            choice["delta"] = {**delta, "content": chunk.text} if chunk.text or is_first else delta
            event = self._object("chat.completion.chunk", [choice])
        else:
            choice["text"] = chunk.text
            event = self._object("text_completion", [choice])
        if self.include_usage:
            event["usage"] = None
        events = [sse_event(event)]
        if chunk.finish_reason is not None and self.include_usage:
            kind = "chat.completion.chunk" if self.is_chat else "text_completion"
            usage = usage_object(self.usage, self.num_tokens)
            events.append(sse_event({**self._object(kind, []), "usage": usage}))
        return events
