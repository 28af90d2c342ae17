"""Stop strings end a request on the token whose text completes them, across token boundaries."""

from __future__ import annotations

from dsv4.runner.stop import TextStopChecker
from dsv4.scheduler.request import Request
from dsv4.text.tokenizer import TextCodec, build_tokenizer
from dsv4.types import SamplingParams


def test_stop_string_spanning_tokens() -> None:
    codec = TextCodec(build_tokenizer(1024))
    ids = codec.encode("the router chooses the least loaded worker")
    request = Request(
        "r", (5, 6), max_new_tokens=100, sampling_params=SamplingParams(stop_strings=("least lo",))
    )
    checker = TextStopChecker(codec)
    hits = []
    for token in ids:
        request.output_token_ids.append(token)
        hits.append(checker(request, (token,)))
    first = hits.index(True)
    assert "least lo" in codec.decode(ids[: first + 1])
    assert "least lo" not in codec.decode(ids[:first])


def test_no_stop_strings_never_stops() -> None:
    codec = TextCodec(build_tokenizer(1024))
    request = Request("r", (5,), max_new_tokens=4, sampling_params=SamplingParams())
    request.output_token_ids.append(7)
    assert not TextStopChecker(codec)(request, (7,))
