"""OpenAI response objects for one request: whole (non-streaming) or as SSE chunks.

Completions are `text_completion` objects; chat answers are `chat.completion` (whole) and
`chat.completion.chunk` (streamed; the first delta carries `role: assistant`). A streamed
request that asked for `stream_options.include_usage` gets `"usage": null` on every chunk and
one last chunk with no choices and the usage, as OpenAI sends it. With logprobs asked, each
choice carries those of its tokens (logprobs.py): a whole answer's all, each streamed chunk its
own (a chunk of tokens whose text is still held back is sent with empty text, for them).
With `echo` (completions) the first chunk's text and logprobs lead with the prompt's (its
tokens and logprobs come with the first token: `StreamChunk.prompt_logprobs`); `echo_only`
(max_tokens 0) answers the prompt alone, usage counting no completion token. vLLM's
`prompt_logprobs` field is on the whole answer's choice and on the first streamed chunk.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dsv4.types import FinishReason, PromptLogprobs, StreamChunk, TokenLogprobs, Usage
from router_svc.http.logprobs import (
    TokenText,
    chat_logprobs,
    completion_logprobs,
    prompt_entries,
    token_texts,
    vllm_prompt_logprobs,
)

FINISH_REASON = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
}
SSE_DONE = b"data: [DONE]\n\n"
# a chunk as the answer shows it: (text, token ids, their logprobs; None where none came)
Shown = tuple[str, tuple[int, ...], tuple[TokenLogprobs | None, ...]]


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
    index: int = 0  # the choice's index (n > 1: one Reply per choice)
    usage_chunk: bool = True  # with include_usage: end with the usage chunk (n > 1: merged)
    # top logprobs asked per token (None: no logprobs) and how token ids read in them
    logprobs: int | None = None
    token_text: TokenText = field(default_factory=lambda: token_texts(None))
    echo: str | None = None  # completions' `echo`: the prompt's text, leading the answer
    echo_only: bool = False  # echo with max_tokens 0: the generated token is left out
    prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs: N` (None: not asked)
    prompt: PromptLogprobs | None = None  # as the first token's chunk brought them
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    usage: Usage | None = None
    token_ids: list[int] = field(default_factory=list)  # kept when logprobs are asked
    token_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    streamed_offset: int = 0  # completions' text_offset after the chunks streamed so far

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.is_chat else 'cmpl'}-{self.request_id}"

    def add(self, chunk: StreamChunk) -> None:
        self._add(chunk, self._shown(chunk))

    def _shown(self, chunk: StreamChunk) -> Shown:
        """`chunk` as the answer shows it: led by the prompt on the first chunk with echo,
        without the generated tokens with echo_only."""
        text, token_ids = chunk.text, chunk.token_ids
        missing = len(token_ids) - len(chunk.logprobs)  # a worker that sent none
        logprobs = (*chunk.logprobs, *(None,) * missing)
        if self.echo_only:
            text, token_ids, logprobs = "", (), ()
        if self.echo is not None and not self.text:  # the first chunk
            prompt = chunk.prompt_logprobs
            text = self.echo + text
            if prompt is not None:  # a worker that sent none: the prompt's tokens left out
                token_ids, logprobs = (*prompt.token_ids, *token_ids), (
                    *prompt_entries(prompt), *logprobs)  # fmt: skip
        return text, token_ids, logprobs

    def _add(self, chunk: StreamChunk, shown: Shown) -> None:
        text, token_ids, logprobs = shown
        self.text.append(text)
        self.num_tokens += 0 if self.echo_only else len(chunk.token_ids)
        if self.logprobs is not None:
            self.token_ids.extend(token_ids)
            self.token_logprobs.extend(logprobs)
        if chunk.prompt_logprobs is not None:
            self.prompt = chunk.prompt_logprobs
        if chunk.finish_reason is not None:
            self.finish_reason = FINISH_REASON[chunk.finish_reason]
            self.usage = chunk.usage
            if self.echo_only and self.usage is not None:  # no completion token answered
                self.usage = dataclasses.replace(self.usage, completion_tokens=0)

    def _vllm_prompt_logprobs(self) -> list[dict[str, Any] | None] | None:
        if self.prompt_logprobs is None or self.prompt is None:
            return None
        return vllm_prompt_logprobs(self.prompt, self.prompt_logprobs, self.token_text)

    def _logprobs_object(
        self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None], offset: int = 0
    ) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        if self.is_chat:
            return chat_logprobs(token_ids, logprobs, self.logprobs, self.token_text)
        return completion_logprobs(token_ids, logprobs, self.logprobs, self.token_text, offset)

    def _object(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}  # fmt: skip

    @property
    def kind(self) -> str:
        """The object type of a whole answer."""
        return "chat.completion" if self.is_chat else "text_completion"

    @property
    def chunk_kind(self) -> str:
        """The object type of a streamed chunk."""
        return "chat.completion.chunk" if self.is_chat else "text_completion"

    def choice(self) -> dict[str, Any]:
        """This choice of the non-streaming answer, after the last chunk."""
        text = "".join(self.text)
        logprobs = self._logprobs_object(self.token_ids, self.token_logprobs)
        out: dict[str, Any] = {"index": self.index, "logprobs": logprobs,
                               "finish_reason": self.finish_reason}  # fmt: skip
        if self.is_chat:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["text"] = text
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = self._vllm_prompt_logprobs()
        return out

    def whole(self) -> dict[str, Any]:
        """The non-streaming answer, after the last chunk."""
        usage = usage_object(self.usage, self.num_tokens)
        return {**self._object(self.kind, [self.choice()]), "usage": usage}

    def stream_events(self, chunk: StreamChunk) -> list[bytes]:
        """`add(chunk)` and the SSE events it makes (none for an empty middle chunk)."""
        is_first = not self.text
        text, token_ids, shown_logprobs = shown = self._shown(chunk)
        self._add(chunk, shown)
        has_logprobs = self.logprobs is not None and bool(token_ids)
        if (not text and chunk.finish_reason is None and not has_logprobs
                and not (is_first and self.is_chat)):  # fmt: skip
            return []
        reason = self.finish_reason if chunk.finish_reason is not None else None
        logprobs = None  # a chunk without tokens (the last, at times) has none to carry
        if has_logprobs:
            logprobs = self._logprobs_object(token_ids, shown_logprobs, self.streamed_offset)
        if logprobs is not None and not self.is_chat:
            self.streamed_offset += sum(len(t) for t in logprobs["tokens"])
        choice: dict[str, Any] = {"index": self.index, "logprobs": logprobs,
                                  "finish_reason": reason}  # fmt: skip
        if self.is_chat:
            delta = {"role": "assistant"} if is_first else {}
            choice["delta"] = {**delta, "content": text} if text or is_first else delta
        else:
            choice["text"] = text
        if self.prompt_logprobs is not None and is_first:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs()
        event = self._object(self.chunk_kind, [choice])
        if self.include_usage:
            event["usage"] = None
        events = [sse_event(event)]
        if chunk.finish_reason is not None and self.include_usage and self.usage_chunk:
            usage = usage_object(self.usage, self.num_tokens)
            events.append(sse_event(self.usage_event(usage)))
        return events

    def usage_event(self, usage: dict[str, int]) -> dict[str, Any]:
        """The last streamed chunk of an include_usage request: no choices, the usage."""
        return {**self._object(self.chunk_kind, []), "usage": usage}
