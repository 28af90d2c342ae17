"""OpenAI's `logprobs`: the sampler's rows against torch's log_softmax (greedy, batched, seeded,
row by row; from the raw logits, so a bias or penalties never change them; rows that did not
ask get none and their tokens stay the same), the wire's limit and round trips (sampling,
stream chunks, P's first token), the engine's refusal with speculation, the router keeping
logprobs with their tokens, the HTTP bodies' parameters and 400s, and the answers' shapes
(completions and chat, whole and streamed). Served on the tiny model:
tests/engine/test_logprobs_served.py; over HTTP through P and D: tests/e2e/test_openai_http.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dsv4 import wire
from dsv4.errors import InvalidRequest
from dsv4.ops.sampling import SamplingSpec
from dsv4.rpc.v1 import common_pb2, router_pb2
from dsv4.runner.logprobs import StepLogprobs
from dsv4.runner.sampler import Sampler
from dsv4.scheduler.request import Request
from dsv4.text.tokenizer import TextCodec, build_tokenizer
from dsv4.types import (
    FinishReason,
    PrefillResult,
    RequestLimits,
    SamplingParams,
    StreamChunk,
    TokenLogprobs,
    Usage,
)
from router_svc.http.errors import ApiError
from router_svc.http.logprobs import clamped, token_texts
from router_svc.http.protocol import parse_request
from router_svc.http.responses import Reply
from router_svc.output import OutputTracker
from tests.leak import assert_no_leaks
from tests.unit.test_wire import HANDLE

LIMITS = RequestLimits(vocab_size=400, max_model_len=64, default_max_new_tokens=16)
INF = float("inf")
SPECS = [
    SamplingSpec(logprobs=3),  # greedy: the device's token
    SamplingSpec(),  # asks none
    SamplingSpec(temperature=1.0, seed=5, logprobs=0),  # seeded: drawn on the host
    SamplingSpec(temperature=0.7, top_k=10, logprobs=20),  # unseeded: batched or on the host
    SamplingSpec(logit_bias=((7, 100.0),), presence_penalty=1.0, logprobs=2),  # shifted greedy
    SamplingSpec(temperature=1.0, top_p=0.5, repetition_penalty=1.5, logprobs=1),
]


@pytest.mark.parametrize("batched", [True, False])
def test_the_samplers_logprobs_are_torchs_log_softmax_of_the_raw_logits(batched: bool) -> None:
    logits = torch.randn(len(SPECS), 64, generator=torch.Generator().manual_seed(3)) * 3
    logits[0, 5] = -INF
    ids, histories = [f"r{i}" for i in range(len(SPECS))], [((1, 2), (3,))] * len(SPECS)
    got = Sampler(batched=batched).sample_rows(logits, ids, SPECS, histories)
    plain = [dataclasses.replace(s, logprobs=None) for s in SPECS]
    assert list(got.token_ids) == Sampler(batched=batched).sample(logits, ids, plain, histories)
    assert got.token_ids[4] == 7  # the bias chose it; its logprob is the raw logits'
    reference = torch.log_softmax(logits, dim=-1)  # [B, V]
    for row, (spec, token, entry) in enumerate(zip(SPECS, got.token_ids, got.logprobs)):
        if spec.logprobs is None:
            assert entry is None
            continue
        assert entry is not None
        assert entry.logprob == pytest.approx(float(reference[row, token]), abs=1e-6)
        values, top_ids = torch.topk(reference[row], spec.logprobs)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-6)
    assert got.logprobs[0].logprob == got.logprobs[0].top[0][1]  # greedy: the most likely


def test_ruled_out_tokens_read_minus_inf_and_rows_that_ask_none_cost_nothing() -> None:
    logits = torch.tensor([[1.0, 0.0, -INF, -INF]])
    (entry,) = Sampler().sample_rows(logits, ["a"], [SamplingSpec(logprobs=4)]).logprobs
    assert entry is not None and [t for t, _ in entry.top[:2]] == [0, 1]
    assert entry.top[2][1] == entry.top[3][1] == -INF
    assert StepLogprobs.of(logits, [SamplingSpec(temperature=1.0)]) is None
    spec, params = SamplingSpec(logprobs=0), SamplingParams(logprobs=0)
    assert spec.needs_logits_processing and not spec.shifts_logits  # off the in-graph argmax
    assert params.needs_logits_processing and not SamplingParams().needs_logits_processing


def test_the_wire_carries_logprobs_and_checks_the_limit() -> None:
    for n in (None, 0, 20):
        sampling = SamplingParams(max_new_tokens=8, logprobs=n)
        assert wire.sampling_from_proto(wire.sampling_to_proto(sampling), LIMITS, 4) == sampling
    for n in (-1, 21):
        with pytest.raises(
            InvalidRequest, match=rf"^sampling.logprobs = {n}: must be in \[0, 20\]"
        ):
            wire.sampling_from_proto(common_pb2.SamplingParams(logprobs=n), LIMITS, 4)
    entries = (TokenLogprobs(-0.5, ((3, -0.5), (9, -1.25))), TokenLogprobs(-INF, ((9, -0.25),)))
    for chunk in (StreamChunk((3, 4), "ab", logprobs=entries),
                  StreamChunk((5,), "", FinishReason.STOP, Usage(), entries[:1])):  # fmt: skip
        assert wire.generate_response_from_proto(wire.generate_response_to_proto(chunk)) == chunk
        assert wire.decode_response_from_proto(wire.decode_response_to_proto(chunk)) == chunk
    short = wire.generate_response_to_proto(StreamChunk((3,), logprobs=entries[:1]))
    short.token_ids.append(4)
    with pytest.raises(InvalidRequest, match="2 token_ids but 1 logprobs"):
        wire.generate_response_from_proto(short)
    uneven = router_pb2.GenerateResponse(token_ids=[3])
    uneven.logprobs.add(logprob=-1.0, top_token_ids=[3, 4], top_logprobs=[-1.0])
    with pytest.raises(InvalidRequest, match="2 top_token_ids but 1 top_logprobs"):
        wire.generate_response_from_proto(uneven)
    first = PrefillResult(42, HANDLE, first_token_logprobs=entries[0])
    assert wire.prefill_result_from_proto(wire.prefill_result_to_proto(first)) == first
    plain = dataclasses.replace(first, first_token_logprobs=None)
    assert wire.prefill_result_from_proto(wire.prefill_result_to_proto(plain)) == plain


def test_a_speculating_engine_refuses_logprobs() -> None:
    from dsv4.config.model import tiny_config
    from dsv4.model.tiny import random_model
    from tests.engine.conftest import make_core

    model = random_model(tiny_config(), seed=3)  # has its MTP layer
    asked = SamplingParams(temperature=0.0, max_new_tokens=4, logprobs=2)
    speculating = make_core(model, spec_tokens=2)
    request = Request("p", (1, 2, 3), max_new_tokens=4, sampling_params=asked)
    with pytest.raises(InvalidRequest, match=r"speculative decoding .* does not support logprobs;"):
        speculating.add_request(request)
    request.output_token_ids.append(7)
    with pytest.raises(InvalidRequest, match="does not support logprobs"):
        speculating.adopt(request)
    core = make_core(model)
    core.add_request(Request("q", (1, 2, 3), max_new_tokens=4, sampling_params=asked))
    assert core.abort("q")
    assert_no_leaks(core, speculating, core.runner.sampler)


def test_the_router_keeps_logprobs_with_their_tokens() -> None:
    lp = [TokenLogprobs(-float(i)) for i in range(4)]
    tracker = OutputTracker(SamplingParams(max_new_tokens=9, stop_token_ids=(8,), logprobs=0),
                            codec=None, eos_token_id=1)  # fmt: skip
    assert tracker.add((5, 6), "", lp[:2]).logprobs == tuple(lp[:2])
    stopped = tracker.add((7, 8, 9), "", lp[1:])  # 8 ends it: 9 and its logprobs are dropped
    assert stopped.token_ids == (7, 8) and stopped.logprobs == tuple(lp[1:3])
    assert tracker.add((4,)).logprobs == ()  # a worker that sent none


def _parse(body: dict, is_chat: bool) -> int | None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    return parse_request(
        {**(chat if is_chat else {"prompt": "x"}), **body}, is_chat=is_chat
    ).logprobs


def test_http_bodies_ask_logprobs_and_bad_ones_are_400s() -> None:
    assert [_parse({"logprobs": n}, False) for n in (None, 0, 5)] == [None, 0, 5]
    chat = [{}, {"logprobs": False}, {"logprobs": True}, {"logprobs": True, "top_logprobs": 7},
            {"logprobs": False, "top_logprobs": 0}, {"logprobs": True, "top_logprobs": None}]  # fmt: skip
    assert [_parse(body, True) for body in chat] == [None, None, 0, 7, None, 0]
    for body, is_chat, param, words in (
        ({"logprobs": True}, False, "logprobs", "must be an integer"),
        ({"logprobs": "3"}, False, "logprobs", "must be an integer"),
        ({"top_logprobs": 2}, False, "top_logprobs", "a chat parameter"),
        ({"logprobs": 3}, True, "logprobs", "must be true or false"),
        ({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs", "must be in [0, 20]"),
        ({"logprobs": True, "top_logprobs": -1}, True, "top_logprobs", "must be in [0, 20]"),
        ({"top_logprobs": 2}, True, "top_logprobs", "needs logprobs = true"),
        ({"logprobs": True, "top_logprobs": 1.5}, True, "top_logprobs", "must be an integer"),
    ):
        with pytest.raises(ApiError) as caught:
            _parse(body, is_chat)
        error = caught.value
        assert (error.status, error.param) == (400, param), (body, error.message)
        assert words in error.message and error.message.startswith(param)
    # the range on /v1/completions is the router's check, named as the client named it
    msg = parse_request({"prompt": "x", "logprobs": 21}, is_chat=False).sampling
    with pytest.raises(InvalidRequest) as refused:
        wire.sampling_from_proto(msg, LIMITS, 4)
    error = ApiError.from_grpc(InvalidRequest.grpc_code, refused.value.message)
    assert (error.status, error.param) == (400, "logprobs")
    assert error.message.startswith("logprobs = 21: must be in [0, 20]")


STRINGS = {5: "He", 6: "llo", 7: "!", 9: "é"}
TOP = {5: ((5, -0.5), (7, -1.5)), 6: ((9, -0.25), (6, -2.0)), 7: ((7, -0.125), (5, -INF))}


def _chunks() -> list[StreamChunk]:
    """He|llo (text held back, then all at once), !, with 2 top logprobs each."""

    def lp(t: int) -> TokenLogprobs:
        return TokenLogprobs(dict(TOP[t])[t], TOP[t])

    return [StreamChunk((5,), "", logprobs=(lp(5),)), StreamChunk((6,), "Hello", logprobs=(lp(6),)),
            StreamChunk((7,), "!", FinishReason.LENGTH, Usage(3, 3), (lp(7),))]  # fmt: skip


def _reply(is_chat: bool, logprobs: int | None = 2) -> Reply:
    return Reply(is_chat, "r", "m", logprobs=logprobs, token_text=STRINGS.__getitem__)


def _streamed(is_chat: bool, chunks: list[StreamChunk]) -> list[dict]:
    reply = _reply(is_chat)
    events = [e for c in chunks for e in reply.stream_events(c)]
    return [json.loads(e.removeprefix(b"data: "))["choices"][0] for e in events]


def test_completion_logprobs_whole_and_streamed() -> None:
    reply = _reply(False)
    for chunk in _chunks():
        reply.add(chunk)
    logprobs = reply.choice()["logprobs"]
    assert logprobs == {
        "tokens": ["He", "llo", "!"], "token_logprobs": [-0.5, -2.0, -0.125],
        # the generated token and the 2 most likely: N + 1 entries when it is not among them
        "top_logprobs": [{"He": -0.5, "!": -1.5}, {"llo": -2.0, "é": -0.25},
                         {"!": -0.125, "He": -9999.0}],  # -inf: JSON-safe
        "text_offset": [0, 2, 5],
    }  # fmt: skip
    streamed = _streamed(False, _chunks())
    assert [c["text"] for c in streamed] == ["", "Hello", "!"]  # held-back text: its logprobs
    joined = {k: [x for c in streamed for x in c["logprobs"][k]] for k in logprobs}
    assert joined == logprobs
    assert Reply(False, "r", "m").choice()["logprobs"] is None  # not asked
    none_sent = _reply(False)
    none_sent.add(StreamChunk((5,), "He", FinishReason.STOP))
    assert none_sent.choice()["logprobs"]["token_logprobs"] == [None]


def test_chat_logprobs_whole_and_streamed() -> None:
    reply = _reply(True)
    for chunk in _chunks():
        reply.add(chunk)
    content = reply.choice()["logprobs"]["content"]
    assert [e["token"] for e in content] == ["He", "llo", "!"]
    assert content[1] == {"token": "llo", "logprob": -2.0, "bytes": list(b"llo"), "top_logprobs": [
        {"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9]},
        {"token": "llo", "logprob": -2.0, "bytes": list(b"llo")}]}  # fmt: skip
    assert content[2]["top_logprobs"][1]["logprob"] == -9999.0
    streamed = _streamed(True, _chunks())
    assert [e for c in streamed for e in c["logprobs"]["content"]] == content
    assert streamed[0]["delta"] == {"role": "assistant", "content": ""}
    one = _reply(True, logprobs=0)
    one.add(StreamChunk((7,), "!", FinishReason.STOP, logprobs=(TokenLogprobs(-0.125, ()),)))
    assert one.choice()["logprobs"]["content"][0]["top_logprobs"] == []
    none_sent = _reply(True)
    none_sent.add(StreamChunk((5,), "He", FinishReason.STOP))
    assert none_sent.choice()["logprobs"]["content"][0]["logprob"] == -9999.0


def test_token_strings_spell_special_tokens_or_ids_without_a_tokenizer() -> None:
    codec = TextCodec(build_tokenizer(1000))
    text = token_texts(codec)
    assert text(1) == "<eos>" and text(codec.encode("hello")[0]) == codec.decode(
        codec.encode("hello")[:1]
    )
    assert token_texts(None)(42) == "token_id:42"
    assert [clamped(v) for v in (-INF, float("nan"), -9999.5, -3.0)] == [-9999.0] * 3 + [-3.0]
