"""Presence, frequency and repetition penalties: the row reference against hand-computed
values, the sampler's rows, the wire's ranges and round trip, and the refusal of a
speculating engine (the served tokens against transformers: tests/model/test_penalties_served.py)."""

from __future__ import annotations

import pytest
import torch

from dsv4 import wire
from dsv4.errors import InvalidRequest
from dsv4.ops.sampling import SamplingSpec, penalized_logits
from dsv4.rpc.v1 import common_pb2
from dsv4.runner.sampler import Sampler
from dsv4.scheduler.request import Request
from dsv4.types import RequestLimits, SamplingParams

LIMITS = RequestLimits(vocab_size=8, max_model_len=64, default_max_new_tokens=16)


def test_penalized_logits_by_hand() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 0.0], dtype=torch.bfloat16)
    spec = SamplingSpec(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    out = penalized_logits(logits, spec, prompt_ids=(0, 1), output_ids=(3, 3, 4))
    # repetition on {0, 1, 3, 4}: positive halved, negative doubled; then the output's 3 (x2)
    # and 4 (x1) lose frequency x count + presence
    expected = torch.tensor([1.0, -2.0, 0.5, 1.5 - 0.5 - 0.5, -4.0 - 0.25 - 0.5, 0.0])
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    assert torch.equal(logits, torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 0.0]).bfloat16())
    assert torch.equal(penalized_logits(logits, SamplingSpec(), (0,), (3,)), logits.float())


def test_the_sampler_penalizes_only_its_rows_and_needs_their_history() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0], [0.0, 5.0, 4.0]])
    plain, penalized = SamplingSpec(), SamplingSpec(presence_penalty=2.0)
    sampler = Sampler()
    history = [((0,), (1,)), ((0,), (1,))]
    assert sampler.sample(logits, ["a", "b"], [plain, penalized], history) == [1, 2]
    assert logits[1, 1] == 5.0  # the caller's logits stay as they were
    with pytest.raises(ValueError, match="penalties need"):
        sampler.sample(logits, ["a", "b"], [plain, penalized])


def test_the_wire_checks_ranges_and_keeps_the_penalties() -> None:
    sampling = SamplingParams(presence_penalty=-2.0, frequency_penalty=1.25, repetition_penalty=2.0,
                              max_new_tokens=8)  # fmt: skip
    msg = wire.sampling_to_proto(sampling)
    back = wire.sampling_from_proto(msg, LIMITS, 4)
    assert (back.presence_penalty, back.frequency_penalty, back.repetition_penalty) == (
        -2.0, 1.25, 2.0,
    )  # fmt: skip
    assert (
        back.has_penalties
        and not wire.sampling_from_proto(common_pb2.SamplingParams(), LIMITS, 4).has_penalties
    )  # unset: off
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", float("nan")),
                         ("repetition_penalty", 0.0), ("repetition_penalty", 2.01)):  # fmt: skip
        with pytest.raises(InvalidRequest, match=f"sampling.{field}"):
            wire.sampling_from_proto(common_pb2.SamplingParams(**{field: value}), LIMITS, 4)


def test_a_speculating_engine_refuses_penalties() -> None:
    from dsv4.config.model import tiny_config
    from dsv4.model.tiny import random_model
    from tests.engine.conftest import make_core

    core = make_core(random_model(tiny_config(), seed=3), spec_tokens=2)  # has its MTP layer
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, max_new_tokens=4)
    request = Request("p", (1, 2, 3), max_new_tokens=4, sampling_params=params)
    with pytest.raises(InvalidRequest, match="speculative decoding"):
        core.add_request(request)
    request.output_token_ids.append(7)
    with pytest.raises(InvalidRequest, match="speculative decoding"):
        core.adopt(request)
    core.add_request(Request("q", (1, 2, 3), max_new_tokens=4))  # no penalties: taken
    assert core.abort("q")
    core.scheduler.check_no_leaks()
