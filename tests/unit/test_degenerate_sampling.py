"""Sampling parameters that cannot produce a token: validation refuses them with the limit,
and every sampler path (row by row, batched torch, the reference) still picks the argmax of
a row whose filtered distribution is empty or NaN instead of raising."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4 import wire
from dsv4.errors import InvalidRequest
from dsv4.ops.limits import MIN_TEMPERATURE, MIN_TOP_P
from dsv4.ops.sampling import SamplingSpec, filtered_probs
from dsv4.rpc.v1 import common_pb2, router_pb2
from dsv4.runner.sampler import Sampler
from dsv4.types import RequestLimits
from kernels.sampling import sample_ref, sample_torch

LIMITS = RequestLimits(vocab_size=1000, max_model_len=64, default_max_new_tokens=16)
# The reproductions of the fault (each wedged a prefill worker): temperature 1e-30, and top_p
# that rounds to 0 in fp32.
DEGENERATE = {
    "top_p 1e-300": dict(temperature=1.0, top_p=1e-300),
    "temperature 1e-30": dict(temperature=1e-30),
    "top_p 1e-45 top_k 1": dict(temperature=1.0, top_p=1e-45, top_k=1),
}


def _generate(**sampling: object) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        request_id="r", prompt_token_ids=common_pb2.TokenIds(ids=[5, 9, 200, 17, 33]),
        sampling=common_pb2.SamplingParams(**sampling),
    )  # fmt: skip


@pytest.mark.parametrize("case", sorted(DEGENERATE))
def test_validation_refuses_sampling_that_cannot_produce_a_token(case: str) -> None:
    with pytest.raises(InvalidRequest, match="must be at least") as refused:
        wire.generate_request_from_proto(_generate(**DEGENERATE[case]), LIMITS)
    limit = "1e-06" if "temperature" in case else f"{MIN_TOP_P:.4g}"
    assert limit in refused.value.message


def test_the_limits_themselves_and_greedy_are_accepted() -> None:
    for sampling in (
        dict(temperature=MIN_TEMPERATURE, top_p=MIN_TOP_P),
        dict(temperature=0.0),
        dict(temperature=1.0, top_k=1),
    ):
        request = wire.generate_request_from_proto(_generate(**sampling), LIMITS)
        assert request.sampling.temperature == sampling["temperature"]


def test_top_p_that_rounds_to_zero_keeps_the_top_token() -> None:
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    for top_p in (1e-300, 1e-45, MIN_TOP_P):
        probs = filtered_probs(logits, SamplingSpec(temperature=1.0, top_p=top_p))
        assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_rows_without_finite_mass_keep_their_argmax() -> None:
    nan_row = torch.tensor([0.5, math.nan, 0.1, 0.2])
    inf_row = torch.tensor([0.5, 0.1, math.inf, 0.2])
    assert filtered_probs(nan_row, SamplingSpec(temperature=1.0)).tolist() == [1, 0, 0, 0]
    assert filtered_probs(inf_row, SamplingSpec(temperature=1.0)).tolist() == [0, 0, 1, 0]
    huge = torch.tensor([3e38, -3e38, 1.0, 0.0])  # / MIN_TEMPERATURE leaves fp32's range
    assert filtered_probs(huge, SamplingSpec(temperature=1e-30)).tolist() == [1, 0, 0, 0]


@pytest.mark.parametrize("batched", [False, True])
def test_sampler_picks_the_argmax_of_unsampleable_rows(batched: bool) -> None:
    """Row by row (seeded and unseeded) and batched torch: no exception, the argmax."""
    logits = torch.tensor(
        [[0.0, 9.0, 1.0, 2.0], [0.5, math.nan, 0.1, 0.2], [3e38, -3e38, 1.0, 0.0], [1, 2, 8, 3.0]]
    )
    specs = [
        SamplingSpec(temperature=1.0, top_p=1e-300),
        SamplingSpec(temperature=1.0),
        SamplingSpec(temperature=1e-30, seed=3),
        SamplingSpec(temperature=1.0, top_p=1e-45, top_k=1),
    ]
    sampler = Sampler(batched=batched)
    for _ in range(20):
        assert sampler.sample(logits, list("abcd"), specs) == [1, 0, 0, 2]


def test_batched_kernels_keep_the_argmax_of_unsampleable_rows() -> None:
    logits = torch.tensor([[0.0, 9.0, 1.0, 2.0], [0.5, math.nan, 0.1, 0.2], [1, 2, 8, 3.0]])
    temperature = torch.tensor([1.0, 1.0, 1e-30])
    top_p = torch.tensor([1e-300, 1.0, 1e-45])  # fp32: 0, 1, a subnormal
    top_k = torch.tensor([0, 0, 1])
    gen = torch.Generator().manual_seed(0)
    for sample in (sample_torch, sample_ref):
        assert sample(logits, temperature, top_p, top_k, gen).tolist() == [1, 0, 2]
