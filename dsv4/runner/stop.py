"""Stop strings: the detokenizing `StopChecker` the scheduler calls after each new token.

A request ends with FinishCause.STOP_STRING once the text of its output tokens contains one of
its stop strings. Only the tail that a new token can have completed is searched: the last
`len(longest stop) + len(new text)` characters.
"""

from __future__ import annotations

from dsv4.scheduler.request import Request
from dsv4.text.tokenizer import TextCodec


class TextStopChecker:
    """Reads `request.sampling_params.stop_strings` (none without sampling params)."""

    def __init__(self, codec: TextCodec) -> None:
        self._codec = codec

    def __call__(self, request: Request, new_token_ids: tuple[int, ...]) -> bool:
        params = request.sampling_params
        stops = params.stop_strings if params is not None else ()
        if not stops:
            return False
        outputs = request.output_token_ids
        text = self._codec.decode(list(outputs))
        before = self._codec.decode(list(outputs[: len(outputs) - len(new_token_ids)]))
        window = max(len(s) for s in stops) + max(0, len(text) - len(before))
        tail = text[-window:]
        return any(stop in tail for stop in stops)
