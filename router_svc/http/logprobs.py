"""OpenAI `logprobs` objects from the router's `TokenLogprobs` (one per generated token).

/v1/completions, as vLLM writes it: `{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}`; a position's `top_logprobs` maps token strings to logprobs for the generated
token and the N most likely (N or N + 1 entries: the generated token is always there), and
`text_offset` counts the characters of the token strings before it (streamed chunks go on from
the previous chunk's). /v1/chat/completions: `{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}]}]}` with the N most likely tokens (OpenAI's
meaning of `top_logprobs`). A token's string is its text decoded alone, special tokens spelled
out; without a tokenizer `token_id:ID` (vLLM's `return_tokens_as_token_ids`); `bytes` are its
string's UTF-8. Logprobs below -9999 (-inf: a token the model rules out; NaN) read -9999.0 as
in vLLM and OpenAI, since JSON has no infinity. A token that came without logprobs (from a
worker that does not send them) gets null ones (completions) or -9999.0 and no top (chat).

With `echo`, a completion's object covers the prompt's tokens first (`PromptLogprobs`: the
first has null `token_logprobs` and `top_logprobs`, as in vLLM). vLLM's own `prompt_logprobs`
field (`vllm_prompt_logprobs`): null for position 0, then per position `{token id (a string,
as JSON writes vLLM's int keys): {"logprob", "rank", "decoded_token"}}` for the prompt token
and the N most likely (ranks 1..N).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from dsv4.text.tokenizer import TextCodec
from dsv4.types import PromptLogprobs, TokenLogprobs

LOWEST_LOGPROB = -9999.0
TOKEN_STRINGS_CACHED = 1 << 17  # a DeepSeek-V4 vocabulary (129K) fits

TokenText = Callable[[int], str]


def token_texts(codec: TextCodec | None) -> TokenText:
    """Token id -> its string in logprobs (cached: answers repeat tokens, and each position
    names N + 1 of them)."""
    if codec is None:
        return lambda token_id: f"token_id:{token_id}"
    return functools.lru_cache(maxsize=TOKEN_STRINGS_CACHED)(codec.token_string)


def clamped(value: float) -> float:
    """A JSON-safe logprob: -inf and NaN read LOWEST_LOGPROB."""
    return value if value >= LOWEST_LOGPROB else LOWEST_LOGPROB


def _entries(
    token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None]
) -> list[tuple[int, TokenLogprobs | None]]:
    """(token, its logprobs or None) per token: a chunk sent without them pads with None."""
    return [(t, logprobs[i] if i < len(logprobs) else None) for i, t in enumerate(token_ids)]


def completion_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None], num_top: int,
    text: TokenText, offset: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """/v1/completions' `choices[i].logprobs` for these tokens; `offset`: text_offset of the
    first (the characters of the token strings before it)."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                 "text_offset": []}  # fmt: skip
    for token, entry in _entries(token_ids, logprobs):
        string = text(token)
        out["tokens"].append(string)
        out["text_offset"].append(offset)
        offset += len(string)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(clamped(entry.logprob))
        top = {string: clamped(entry.logprob)}
        for other, value in entry.top[:num_top]:
            top.setdefault(text(other), clamped(value))
        out["top_logprobs"].append(top)
    return out


def _chat_token(string: str, value: float) -> dict[str, Any]:
    return {"token": string, "logprob": clamped(value),
            "bytes": list(string.encode("utf-8", errors="replace"))}  # fmt: skip


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None], num_top: int,
    text: TokenText,
) -> dict[str, Any]:  # fmt: skip
    """/v1/chat/completions' `choices[i].logprobs` for these tokens."""
    content = []
    for token, entry in _entries(token_ids, logprobs):
        value = entry.logprob if entry is not None else LOWEST_LOGPROB
        tops = entry.top[:num_top] if entry is not None else ()
        content.append({**_chat_token(text(token), value),
                        "top_logprobs": [_chat_token(text(t), v) for t, v in tops]})  # fmt: skip
    return {"content": content}


def prompt_entries(prompt: PromptLogprobs) -> tuple[TokenLogprobs | None, ...]:
    """One entry per prompt token, as `completion_logprobs` takes them: None for position 0."""
    return (None, *prompt.positions) if prompt.token_ids else ()


def _vllm_logprob(value: float, rank: int | None, string: str) -> dict[str, Any]:
    return {"logprob": clamped(value), "rank": rank, "decoded_token": string}


def vllm_prompt_logprobs(
    prompt: PromptLogprobs, num_top: int, text: TokenText
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` of a choice: null, then one object per prompt position."""
    out: list[dict[str, Any] | None] = [None] if prompt.token_ids else []
    for token, entry in zip(prompt.token_ids[1:], prompt.positions):
        at = {str(token): _vllm_logprob(entry.logprob, entry.rank, text(token))}
        for rank, (other, value) in enumerate(entry.top[:num_top], start=1):
            at.setdefault(str(other), _vllm_logprob(value, rank, text(other)))
        out.append(at)
    return out
