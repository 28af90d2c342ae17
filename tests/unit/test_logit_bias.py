"""OpenAI's `logit_bias`: the row reference by hand, the sampler's rows (a bias moves the
argmax, -100 bans a token also when sampling, the bias comes before the penalties as in vLLM's
sampler), its per-request device copy freed with the request, the wire's limits and round
trip, the engine's refusals (speculation, ids outside the vocabulary) and the HTTP body's
shape checks. Served tokens on the tiny model: tests/engine/test_logit_bias_served.py; over
HTTP through P and D: tests/e2e/test_openai_http.py."""

from __future__ import annotations

import pytest
import torch

from dsv4 import wire
from dsv4.errors import InvalidRequest
from dsv4.ops.sampling import SamplingSpec, biased_logits, penalized_logits
from dsv4.rpc.v1 import common_pb2
from dsv4.runner.sampler import Sampler
from dsv4.scheduler.request import Request
from dsv4.types import RequestLimits, SamplingParams
from router_svc.http.errors import ApiError
from router_svc.http.protocol import parse_request
from tests.leak import assert_no_leaks

LIMITS = RequestLimits(vocab_size=400, max_model_len=64, default_max_new_tokens=16)


def test_biased_logits_by_hand() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, float("-inf")], dtype=torch.bfloat16)
    spec = SamplingSpec(logit_bias=((0, -100.0), (2, 3.25), (3, 100.0)))
    out = biased_logits(logits, spec)
    expected = torch.tensor([-98.0, -1.0, 3.75, float("-inf")])
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    assert logits[0] == 2.0  # the caller's row stays as it was
    assert torch.equal(biased_logits(logits, SamplingSpec()), logits.float())


def test_a_bias_moves_the_greedy_token_and_minus_100_bans_one() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]] * 3)
    specs = [SamplingSpec(), SamplingSpec(logit_bias=((3, 100.0),)),
             SamplingSpec(logit_bias=((1, -100.0),))]  # fmt: skip
    sampler = Sampler()
    # rows with a bias but no penalties need no history
    assert sampler.sample(logits, ["a", "b", "c"], specs) == [1, 3, 2]
    assert logits[1, 3] == 1.0 and logits[2, 1] == 5.0  # the caller's logits stay as they were
    assert specs[1].needs_logits_processing and not specs[1].has_penalties
    # sampling (seeded and batched): the banned token, by far the likeliest, never comes
    banned = SamplingSpec(temperature=1.0, logit_bias=((0, -100.0),))
    peaked = torch.tensor([[12.0, 0.0, 0.0, 0.0]] * 2)
    batched = Sampler(batched=True)
    for step in range(200):
        seeded = SamplingSpec(temperature=1.0, seed=3, logit_bias=banned.logit_bias)
        chosen = batched.sample(peaked, ["s", "u"], [seeded, banned])
        assert 0 not in chosen, (step, chosen)
    assert Sampler().sample(peaked[:1], ["x"], [SamplingSpec(temperature=1.0, seed=3)]) == [0]


def test_the_bias_comes_before_the_penalties_as_in_vllm() -> None:
    """Token 0 (seen in the prompt, logit 2) gets +2 and a repetition penalty of 2; token 1
    has 2.5. Bias first (vLLM): (2 + 2) / 2 = 2 < 2.5; penalties first would give 3 > 2.5."""
    logits = torch.tensor([[2.0, 2.5, 0.0]])
    spec = SamplingSpec(repetition_penalty=2.0, logit_bias=((0, 2.0),))
    history = ((0,), ())
    reference = penalized_logits(biased_logits(logits[0], spec), spec, *history)
    assert torch.equal(reference, torch.tensor([2.0, 2.5, 0.0]))
    sampler = Sampler()
    assert sampler.sample(logits, ["r"], [spec], [history]) == [1]
    with pytest.raises(ValueError, match="penalties need"):
        sampler.sample(logits, ["r"], [spec])
    sampler.release("r")
    assert_no_leaks(sampler)


def test_the_sampler_keeps_one_bias_per_request_and_frees_it() -> None:
    sampler, logits = Sampler(), torch.zeros(2, 8)
    plus, minus = SamplingSpec(logit_bias=((5, 1.0),)), SamplingSpec(logit_bias=((6, 1.0),))
    assert sampler.sample(logits, ["p", "q"], [plus, SamplingSpec()]) == [5, 0]
    assert sampler.num_live_logit_biases == 1  # the plain row keeps none
    assert sampler.sample(logits, ["p", "q"], [minus, SamplingSpec()]) == [6, 0]  # id reused
    with pytest.raises(ValueError, match=r"in \[0, 8\)"):
        sampler.sample(logits[:1], ["z"], [SamplingSpec(logit_bias=((8, 1.0),))])
    assert "1 logit biases" in sampler.find_leaks()[0]
    sampler.release("p")
    assert_no_leaks(sampler)


def test_the_wire_keeps_the_bias_and_checks_openais_limits() -> None:
    sampling = SamplingParams(logit_bias=((3, -100.0), (50, 0.5), (399, 100.0)), max_new_tokens=8)
    back = wire.sampling_from_proto(wire.sampling_to_proto(sampling), LIMITS, 4)
    assert back.logit_bias == sampling.logit_bias and back.needs_logits_processing
    unset = wire.sampling_from_proto(common_pb2.SamplingParams(), LIMITS, 4)
    assert unset.logit_bias == () and not unset.needs_logits_processing
    unsorted = common_pb2.SamplingParams(logit_bias={9: 1.0, 2: -1.0})
    assert wire.sampling_from_proto(unsorted, LIMITS, 4).logit_bias == ((2, -1.0), (9, 1.0))
    full = {t: 1.0 for t in range(300)}
    assert len(wire.sampling_from_proto(common_pb2.SamplingParams(logit_bias=full), LIMITS, 4)
               .logit_bias) == 300  # fmt: skip
    for bias, match in (({t: 1.0 for t in range(301)}, "has 301 entries"),
                        ({-1: 1.0}, "token id -1, outside"), ({400: 1.0}, "token id 400"),
                        ({7: 100.5}, r"\[7\] = 100.5: must be in \[-100, 100\]"),
                        ({7: float("nan")}, r"\[7\] = nan"), ({7: -101.0}, "-101.0")):  # fmt: skip
        with pytest.raises(InvalidRequest, match=f"^sampling.logit_bias.*{match}"):
            wire.sampling_from_proto(common_pb2.SamplingParams(logit_bias=bias), LIMITS, 4)


def test_the_engine_refuses_a_bias_it_cannot_apply() -> None:
    """A speculating engine refuses it as it refuses penalties; an id outside the model's
    vocabulary (wire checks skipped) is an InvalidRequest, INVALID_ARGUMENT on gRPC."""
    from dsv4.config.model import tiny_config
    from dsv4.model.tiny import random_model
    from tests.engine.conftest import make_core

    model = random_model(tiny_config(), seed=3)  # has its MTP layer
    biased = SamplingParams(temperature=0.0, logit_bias=((5, 1.0),), max_new_tokens=4)
    speculating = make_core(model, spec_tokens=2)
    request = Request("p", (1, 2, 3), max_new_tokens=4, sampling_params=biased)
    with pytest.raises(
        InvalidRequest, match=r"speculative decoding .* does not support logit_bias;"
    ):
        speculating.add_request(request)
    request.output_token_ids.append(7)
    with pytest.raises(InvalidRequest, match="speculative decoding"):
        speculating.adopt(request)
    both = SamplingParams(temperature=0.0, logit_bias=((5, 1.0),), presence_penalty=1.0)
    with pytest.raises(InvalidRequest, match="repetition penalties or logit_bias;"):
        speculating.add_request(Request("b", (1, 2), max_new_tokens=4, sampling_params=both))
    core = make_core(model)
    vocab = model.cfg.vocab_size
    outside = SamplingParams(temperature=0.0, logit_bias=((vocab, 1.0),), max_new_tokens=4)
    with pytest.raises(InvalidRequest, match=rf"token id {vocab} is outside .* \[0, {vocab}\)"):
        core.add_request(Request("o", (1, 2, 3), max_new_tokens=4, sampling_params=outside))
    assert InvalidRequest.grpc_code == "INVALID_ARGUMENT"
    core.add_request(Request("q", (1, 2, 3), max_new_tokens=4, sampling_params=biased))
    assert core.abort("q")
    assert_no_leaks(core, speculating, core.runner.sampler)


def test_http_bodies_carry_the_bias_and_bad_ones_are_400s() -> None:
    body = {"prompt": "x", "logit_bias": {"50256": -100, "7": 2.5, "-3": 1}}
    sampling = parse_request(body, is_chat=False).sampling
    assert dict(sampling.logit_bias) == {50256: -100.0, 7: 2.5, -3: 1.0}  # -3: the router's
    assert not parse_request({"prompt": "x", "logit_bias": {}}, is_chat=False).sampling.logit_bias
    chat = parse_request({"messages": [{"role": "user", "content": "hi"}],
                          "logit_bias": {"5": 100}}, is_chat=True)  # fmt: skip
    assert dict(chat.sampling.logit_bias) == {5: 100.0}
    for bias, words in ((["5"], "must be an object"), ({"abc": 1}, "key 'abc': must be a token"),
                        ({"1.5": 1}, "key '1.5'"), ({"": 1}, "key ''"),
                        ({"99999999999": 1}, "key '99999999999'"),
                        ({"5": "1"}, "logit_bias[5] = '1': must be a number"),
                        ({"5": True}, "= True"), ({"5": None}, "= None")):  # fmt: skip
        with pytest.raises(ApiError) as caught:
            parse_request({"prompt": "x", "logit_bias": bias}, is_chat=False)
        error = caught.value
        assert error.status == 400 and error.param == "logit_bias", (bias, error.message)
        assert words in error.message and "\n" not in error.message
    # the router's range checks come back under the OpenAI name
    msg = parse_request({"prompt": "x", "logit_bias": {"7": 150}}, is_chat=False).sampling
    with pytest.raises(InvalidRequest) as refused:
        wire.sampling_from_proto(msg, LIMITS, 4)
    error = ApiError.from_grpc(InvalidRequest.grpc_code, refused.value.message)
    assert (error.status, error.param) == (400, "logit_bias")
    assert error.message.startswith("logit_bias[7] = 150.0: must be in [-100, 100]")
