"""/v1/completions' `echo` and vLLM's `prompt_logprobs`: the bodies (what the engine is asked,
max_tokens 0 with echo, the 400s, chat refusing both) and the answers' shapes (the prompt
leading the text and the logprobs object, whole and streamed; the prompt alone with
max_tokens 0; vLLM's `prompt_logprobs` field). Through the router and P + D with the openai
client: tests/e2e/test_openai_http.py."""

from __future__ import annotations

import json

import pytest

from dsv4.types import FinishReason, PromptLogprobs, StreamChunk, TokenLogprobs, Usage
from router_svc.http.errors import ApiError
from router_svc.http.protocol import parse_request
from router_svc.http.responses import Reply

STRINGS = {5: "He", 6: "llo", 7: "!", 9: " w"}
PROMPT = PromptLogprobs((5, 6), (TokenLogprobs(-2.0, ((9, -0.5), (6, -2.0)), rank=2),))


def _completion(**body: object):
    return parse_request({"prompt": "Hello", **body}, is_chat=False)


def test_echo_asks_the_prompts_logprobs_the_answer_needs() -> None:
    cases = [  # body -> (echo, echo_only, max_new_tokens, engine's prompt_logprobs, field's)
        ({}, (False, False, None, None, None)),
        ({"echo": True}, (True, False, None, None, None)),
        ({"echo": True, "logprobs": 3}, (True, False, None, 3, None)),
        ({"logprobs": 3}, (False, False, None, None, None)),  # no echo: the prompt's not needed
        ({"echo": True, "max_tokens": 0, "logprobs": 1}, (True, True, 1, 1, None)),
        ({"prompt_logprobs": 2}, (False, False, None, 2, 2)),
        ({"echo": True, "logprobs": 4, "prompt_logprobs": 2}, (True, False, None, 4, 2)),
        ({"echo": False, "max_tokens": 0}, (False, False, 0, None, None)),  # the router's 400
    ]
    for body, want in cases:
        parsed = _completion(**body)
        s = parsed.sampling
        got = (parsed.echo, parsed.echo_only,
               s.max_new_tokens if s.HasField("max_new_tokens") else None,
               s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
               parsed.prompt_logprobs)  # fmt: skip
        assert got == want, body


@pytest.mark.parametrize(
    ("body", "is_chat", "param", "words"),
    [
        ({"echo": "yes"}, False, "echo", "must be true or false"),
        ({"prompt_logprobs": 21}, False, "prompt_logprobs", "must be in [0, 20]"),
        ({"prompt_logprobs": -1}, False, "prompt_logprobs", "must be in [0, 20]"),
        ({"prompt_logprobs": 1.5}, False, "prompt_logprobs", "must be an integer"),
        ({"echo": True}, True, "echo", "not supported on /v1/chat/completions"),
        ({"prompt_logprobs": 0}, True, "prompt_logprobs", "not supported on /v1/chat"),
    ],
)
def test_bad_echo_bodies_are_400s_naming_the_parameter(body, is_chat, param, words) -> None:
    base = {"messages": [{"role": "user", "content": "hi"}]} if is_chat else {"prompt": "x"}
    with pytest.raises(ApiError) as caught:
        parse_request({**base, **body}, is_chat=is_chat)
    error = caught.value
    assert (error.status, error.param) == (400, param) and words in error.message


def _chunks(prompt: PromptLogprobs | None = PROMPT) -> list[StreamChunk]:
    """The completion " w" then "!" after the prompt "Hello" (ids 5, 6), 1 top logprob."""
    return [StreamChunk((9,), " w", logprobs=(TokenLogprobs(-0.5, ((9, -0.5),)),),
                        prompt_logprobs=prompt),
            StreamChunk((7,), "!", FinishReason.LENGTH, Usage(2, 2),
                        (TokenLogprobs(-0.25, ((7, -0.25),)),))]  # fmt: skip


def _reply(**more: object) -> Reply:
    return Reply(False, "r", "m", token_text=STRINGS.__getitem__, echo="Hello", **more)


def _streamed(reply: Reply, chunks: list[StreamChunk]) -> list[dict]:
    events = [e for c in chunks for e in reply.stream_events(c)]
    return [json.loads(e.removeprefix(b"data: "))["choices"][0] for e in events]


def test_echo_leads_the_text_and_logprobs_with_the_prompt_whole_and_streamed() -> None:
    reply = _reply(logprobs=1)
    for chunk in _chunks():
        reply.add(chunk)
    choice = reply.choice()
    assert choice["text"] == "Hello w!" and "prompt_logprobs" not in choice
    assert choice["logprobs"] == {
        "tokens": ["He", "llo", " w", "!"],
        "token_logprobs": [None, -2.0, -0.5, -0.25],  # the first prompt token has none
        "top_logprobs": [None, {"llo": -2.0, " w": -0.5}, {" w": -0.5}, {"!": -0.25}],
        "text_offset": [0, 2, 5, 7],
    }
    assert reply.whole()["usage"] == {"prompt_tokens": 2, "completion_tokens": 2,
                                      "total_tokens": 4}  # fmt: skip
    streamed = _streamed(_reply(logprobs=1), _chunks())
    assert [c["text"] for c in streamed] == ["Hello w", "!"]  # the first chunk: the prompt too
    joined = {k: [x for c in streamed for x in c["logprobs"][k]] for k in choice["logprobs"]}
    assert joined == choice["logprobs"]
    plain = _reply()  # echo without logprobs
    for chunk in _chunks(None):
        plain.add(chunk)
    assert plain.choice()["text"] == "Hello w!" and plain.choice()["logprobs"] is None


def test_echo_with_max_tokens_0_answers_the_prompt_alone() -> None:
    reply = _reply(logprobs=1, echo_only=True)
    for chunk in _chunks()[:1]:  # max_new_tokens 1: the first chunk is the last
        reply.add(StreamChunk(chunk.token_ids, chunk.text, FinishReason.LENGTH, Usage(2, 1),
                              chunk.logprobs, chunk.prompt_logprobs))  # fmt: skip
    choice = reply.choice()
    assert choice["text"] == "Hello" and choice["logprobs"]["tokens"] == ["He", "llo"]
    assert choice["logprobs"]["token_logprobs"] == [None, -2.0]
    assert reply.whole()["usage"]["completion_tokens"] == 0  # no completion token answered
    streamed = _streamed(_reply(echo_only=True), _chunks())
    assert [c["text"] for c in streamed] == ["Hello", ""]
    assert [c["finish_reason"] for c in streamed] == [None, "length"]


def test_vllms_prompt_logprobs_field_whole_and_on_the_first_chunk() -> None:
    want = [None, {"6": {"logprob": -2.0, "rank": 2, "decoded_token": "llo"},
                   "9": {"logprob": -0.5, "rank": 1, "decoded_token": " w"}}]  # fmt: skip
    reply = Reply(False, "r", "m", token_text=STRINGS.__getitem__, prompt_logprobs=2)
    for chunk in _chunks():
        reply.add(chunk)
    choice = reply.choice()
    assert choice["prompt_logprobs"] == want and choice["text"] == " w!"  # no echo
    streamed = _streamed(Reply(False, "r", "m", token_text=STRINGS.__getitem__,
                               prompt_logprobs=0), _chunks())  # fmt: skip
    assert streamed[0]["prompt_logprobs"] == [None, {"6": want[1]["6"]}]  # the token alone
    assert "prompt_logprobs" not in streamed[1]
    missing = Reply(False, "r", "m", prompt_logprobs=1)
    missing.add(StreamChunk((9,), "x", FinishReason.STOP))  # a worker that sent none
    assert missing.choice()["prompt_logprobs"] is None
