"""The router's view of one request's output: token counting, incremental text, stop rules.

Decision (stop strings): the router enforces stop strings, because it is the only process that
sees the whole output text (P's first token and D's stream, across a migration too). Workers
receive the strings as well and may stop on them; whoever stops first wins, and when the router
stops first it aborts the request on D. On a match the text is cut before the stop string and
the token that completed it is the last token sent. While a stop string could still be
forming, up to `max(len(stop)) - 1` characters of text are held back (token ids are never held
back, so TTFT is unaffected). The router also re-checks stop token ids, EOS and max_new_tokens,
so a first token that already ends the request never reaches D, and a worker that overshoots is
cut off. Without a tokenizer the router relays the workers' text and leaves stop strings to them.

Pure Python, used by one request flow at a time on the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers.decoders import DecodeStream

from dsv4.text.tokenizer import TextCodec
from dsv4.types import FinishReason, PromptLogprobs, SamplingParams, TokenLogprobs

NUM_PROMPT_CONTEXT_TOKENS = 6  # prompt tail decoded with the output, so spacing comes out right
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text of streamed token ids, one token at a time, holding back incomplete UTF-8.

    `tokenizers.decoders.DecodeStream` does the work: it decodes only a short window per token
    (vLLM's prefix/read offsets), so a long output costs O(n), not O(n^2). It is seeded with
    the prompt's tail, cut back to where that tail decodes to whole characters (a token-id
    prompt may end mid-character; its stray bytes are not the output's).
    """

    def __init__(self, codec: TextCodec, prompt_token_ids: Sequence[int] = ()) -> None:
        tail = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        while tail and codec.decode(tail).endswith(_REPLACEMENT_CHAR):
            tail.pop()
        self._tokenizer = codec.tokenizer
        self._stream = DecodeStream(tail, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """The text this token completes (may be empty mid-character)."""
        return self._stream.step(self._tokenizer, token_id) or ""


@dataclass(frozen=True, slots=True)
class OutputStep:
    """What to send for one batch of tokens: accepted ids (and their logprobs, when the
    request asked), text to send now, and the finish reason when the router decided the
    request is over; with the first token, the prompt's logprobs when the request asked."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: PromptLogprobs | None = None


class OutputTracker:
    """Counts and checks every token a request produces; `add` per message, `flush` at the end."""

    def __init__(
        self,
        sampling: SamplingParams,
        *,
        codec: TextCodec | None,
        eos_token_id: int | None,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self._sampling = sampling
        self._detok = IncrementalDetokenizer(codec, prompt_token_ids) if codec else None
        self._stop_ids = frozenset(sampling.stop_token_ids)
        if eos_token_id is not None and not sampling.ignore_eos:
            self._stop_ids |= {eos_token_id}
        self._stops = sampling.stop_strings if self._detok is not None else ()
        self._holdback_chars = max((len(s) for s in self._stops), default=1) - 1
        self._text = ""
        self._num_chars_sent = 0
        self.token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_left(self) -> int:
        return self._sampling.max_new_tokens - len(self.token_ids)

    def add(
        self, token_ids: Sequence[int], worker_text: str = "",
        logprobs: Sequence[TokenLogprobs] = (), prompt: PromptLogprobs | None = None,
    ) -> OutputStep:  # fmt: skip
        """Accept tokens in order until one ends the request; `worker_text` is used only when
        the router has no tokenizer; `logprobs` (one per token, or none) follow their tokens,
        `prompt` (the prompt's logprobs, with the first token) goes with them. Tokens after a
        finish are dropped."""
        accepted: list[int] = []
        for token_id in token_ids:
            if self.finish_reason is not None:
                break
            accepted.append(token_id)
            self.token_ids.append(token_id)
            self.finish_reason = self._check(token_id)
        if self._detok is None:
            self._text += worker_text
        kept = tuple(logprobs[: len(accepted)])
        return OutputStep(tuple(accepted), self._take_text(), self.finish_reason, kept, prompt)

    def flush(self) -> str:
        """Text still held back; call once when the stream ends."""
        text = self._text[self._num_chars_sent :]
        self._num_chars_sent = len(self._text)
        return text

    def _check(self, token_id: int) -> FinishReason | None:
        if self._detok is not None:
            start = max(0, len(self._text) - self._holdback_chars)
            self._text += self._detok.add(token_id)
            if self._stops and self._cut_at_stop_string(start):
                return FinishReason.STOP
        if token_id in self._stop_ids:
            return FinishReason.STOP
        if len(self.token_ids) >= self._sampling.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def _cut_at_stop_string(self, start: int) -> bool:
        hits = [i for i in (self._text.find(s, start) for s in self._stops) if i >= 0]
        if not hits:
            return False
        self._text = self._text[: min(hits)]
        return True

    def _take_text(self) -> str:
        end = len(self._text)
        if self.finish_reason is None and self._holdback_chars:
            end = max(self._num_chars_sent, end - self._holdback_chars)
        text = self._text[self._num_chars_sent : end]
        self._num_chars_sent = end
        return text
