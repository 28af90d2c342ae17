"""Presence, frequency and repetition penalties: the row reference against hand-computed
values, the sampler's incremental per-request state bit for bit against it (and freed with
its request), the sampler's rows, the wire's ranges and round trip, and the refusal of a
speculating engine (the served tokens against transformers: tests/model/test_penalties_served.py)."""

from __future__ import annotations

import pytest
import torch

from dsv4 import wire
from dsv4.errors import InvalidRequest
from dsv4.ops.sampling import SamplingSpec, penalized_logits
from dsv4.rpc.v1 import common_pb2
from dsv4.runner.sampler import PenaltyState, Sampler
from dsv4.scheduler.request import Request
from dsv4.types import RequestLimits, SamplingParams
from tests.leak import assert_no_leaks

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SPECS = [
    SamplingSpec(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.7),
    SamplingSpec(presence_penalty=-1.5, frequency_penalty=-0.4),
    SamplingSpec(repetition_penalty=0.3),
    SamplingSpec(frequency_penalty=1.25),
    SamplingSpec(presence_penalty=2.0, repetition_penalty=2.0, temperature=1.0),
]

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


def _random_logits(vocab: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """Negative and positive logits, some exact zeros (and -0.0), some +-inf."""
    logits = torch.randn(vocab, generator=gen) * 4
    logits[torch.randint(0, vocab, (4,), generator=gen)] = 0.0
    logits[torch.randint(0, vocab, (2,), generator=gen)] = -0.0
    logits[torch.randint(0, vocab, (2,), generator=gen)] = float("-inf")
    logits[torch.randint(0, vocab, (1,), generator=gen)] = float("inf")
    return logits.to(device)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float32 and torch.equal(a.view(torch.int32),
                                                                b.view(torch.int32))  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", SPECS)
def test_the_incremental_state_equals_the_reference_bit_for_bit(spec, device) -> None:
    """Random histories (repeats in the prompt and the output, the empty output first), the
    state counting one or a few new output tokens per step, against `penalized_logits`."""
    vocab, gen = 64, torch.Generator().manual_seed(17)
    for trial in range(4):
        prompt = tuple(torch.randint(0, vocab, (trial * 9,), generator=gen).tolist())
        output: list[int] = []
        state = PenaltyState(prompt, torch.empty(1, vocab, device=device))
        for _ in range(12):
            logits = _random_logits(vocab, gen, device)
            state.count(tuple(output))
            row = logits.clone()
            state.apply(row, spec)
            assert _same_bits(row, penalized_logits(logits, spec, prompt, tuple(output)))
            step = int(torch.randint(1, 4, (), generator=gen))  # 1..3 new tokens at once
            output += torch.randint(0, vocab // 4, (step,), generator=gen).tolist()
        assert int(state.counts.sum()) < len(output)  # the last tokens are not counted yet


@pytest.mark.parametrize("device", DEVICES)
def test_the_sampler_rebuilds_a_state_its_history_does_not_extend(device) -> None:
    """The sampler keeps one state per request id and counts only the new output tokens; a
    history that does not extend the counted one (shorter, or another last token, or another
    prompt) rebuilds it. Each step's tokens are the reference's argmax; `release` frees it."""
    vocab, gen = 96, torch.Generator().manual_seed(5)
    spec = SamplingSpec(presence_penalty=1.5, frequency_penalty=0.75, repetition_penalty=1.9)
    sampler = Sampler()
    prompt = tuple(torch.randint(0, vocab, (40,), generator=gen).tolist())
    histories = [(prompt, ()), (prompt, (3, 3, 7)), (prompt, (3, 3, 7, 1, 3)),  # extends
                 (prompt, (3, 3)), (prompt, (3, 3, 9)), (prompt[:7], (3, 3, 9)),  # rebuilds
                 ((), (5,)), ((), ())]  # fmt: skip
    for prompt_ids, output_ids in histories:
        logits = torch.stack([_random_logits(vocab, gen, device) for _ in range(2)])
        logits[:, torch.randint(0, vocab, (2,), generator=gen)] = float("nan")
        chosen = sampler.sample(logits, ["p", "plain"], [spec, SamplingSpec()],
                                [(prompt_ids, output_ids), ((), ())])  # fmt: skip
        reference = penalized_logits(logits[0], spec, prompt_ids, output_ids)
        assert chosen == [int(reference.argmax()), int(logits[1].argmax())]
        assert sampler.num_live_penalty_states == 1  # the plain row keeps none
        row = logits[0].clone()
        sampler._penalties["p"].apply(row, spec)  # the state as this step left it
        assert _same_bits(row, reference)
    sampler.release("p")
    assert sampler.num_live_penalty_states == 0
    assert_no_leaks(sampler)


def test_an_engine_frees_the_penalty_states_of_finished_and_aborted_requests() -> None:
    """Penalized requests through the engine: each one's state lives while it runs; the batch
    after a request finished or was aborted frees it (and the seeded one's generator), also
    when an idle step came between (its empty batch used to drop the finished ids)."""
    from dsv4.config.model import tiny_config
    from dsv4.model.tiny import random_model
    from tests.engine.conftest import make_core, run_to_completion

    core = make_core(random_model(tiny_config().with_overrides(num_nextn_predict_layers=0),
                                  seed=3))  # fmt: skip
    sampler = core.runner.sampler
    penalties = [SamplingParams(repetition_penalty=1.5, max_new_tokens=6),
                 SamplingParams(temperature=1.0, seed=7, presence_penalty=1.0,
                                frequency_penalty=0.5, max_new_tokens=6),
                 SamplingParams(frequency_penalty=-0.5, max_new_tokens=6)]  # fmt: skip
    for n, params in enumerate(penalties):
        core.add_request(Request(f"r{n}", (1, 2, 3, 2, 1 + n), max_new_tokens=6,
                                 eos_token_id=None, sampling_params=params))  # fmt: skip
    core.step()  # the prefills sample: every request has its state
    assert sampler.num_live_penalty_states == 3 and sampler.num_live_generators == 1
    assert core.abort("r2")
    outputs = run_to_completion(core)
    assert [len(outputs[f"r{n}"]) for n in range(2)] == [5, 5]  # the prefill's first not here
    assert core.step() == []  # an idle step: the finished ids wait for the next batch
    core.add_request(Request("flush", (4, 5), max_new_tokens=1, eos_token_id=None))
    run_to_completion(core)  # its batch tells the runner which requests left
    assert_no_leaks(sampler, core)
