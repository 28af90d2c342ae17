"""Incremental detokenization of one decode stream (text deltas per message)."""

from __future__ import annotations

from dsv4.text.tokenizer import TextCodec


class TextDeltas:
    """Text of each new chunk of tokens, given everything generated so far.

    `already_sent` tokens (P's first token, whose text P sent) count as context only. Holds
    back an incomplete UTF-8 tail until the next chunk completes it. Without a codec: "".
    """

    def __init__(self, codec: TextCodec | None, already_sent: tuple[int, ...] = ()) -> None:
        self._codec = codec
        self._ids = list(already_sent)
        self._num_emitted = len(self._ids)

    def add(self, token_ids: tuple[int, ...]) -> str:
        self._ids.extend(token_ids)
        if self._codec is None:
            return ""
        text = self._codec.decode_delta(self._ids, self._num_emitted)
        if text:
            self._num_emitted = len(self._ids)
        return text
