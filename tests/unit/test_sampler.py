"""Sampler: greedy, filters, per-request seeds independent of batch composition."""

from __future__ import annotations

import torch

from dsv4.runner.sampler import Sampler, SamplingSpec, filtered_probs


def test_greedy_is_argmax_and_lowest_id_on_ties() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    sampler = Sampler()
    assert sampler.sample(logits, ["a", "b"], [SamplingSpec(), SamplingSpec()]) == [1, 0]
    assert sampler.num_live_generators == 0


def test_top_k_keeps_only_k_largest() -> None:
    probs = filtered_probs(
        torch.tensor([1.0, 4.0, 3.0, 2.0]), SamplingSpec(temperature=1.0, top_k=2)
    )
    assert probs[0] == 0 and probs[3] == 0
    assert torch.isclose(probs.sum(), torch.tensor(1.0))
    # softmax over {4, 3}: e / (e + 1)
    assert torch.isclose(probs[1], torch.tensor(torch.e / (torch.e + 1)))


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = filtered_probs(logits, SamplingSpec(temperature=1.0, top_p=0.8))
    # 0.5 < 0.8, 0.5 + 0.3 = 0.8 reaches it: keep ids 0 and 1 only.
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_seeded_request_is_independent_of_batch_neighbours() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    spec = SamplingSpec(temperature=1.0, seed=1234)
    alone = Sampler()
    seq_alone = [alone.sample(logits[1:2], ["r"], [spec])[0] for _ in range(20)]
    batched = Sampler()
    other = SamplingSpec(temperature=1.0)
    seq_batched = [
        batched.sample(logits, ["x", "r", "y"], [other, spec, other])[1] for _ in range(20)
    ]
    assert seq_alone == seq_batched
    batched.release("r")
    assert batched.num_live_generators == 0


def test_sampling_matches_distribution() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    sampler = Sampler(default_seed=7)
    counts = torch.zeros(3)
    spec = SamplingSpec(temperature=1.0)
    for _ in range(3000):
        counts[sampler.sample(logits, ["r"], [spec])[0]] += 1
    # 3000 draws: each frequency within 4 standard deviations of its probability.
    freq = counts / 3000
    expected = torch.tensor([0.6, 0.3, 0.1])
    sigma = (expected * (1 - expected) / 3000).sqrt()
    assert ((freq - expected).abs() < 4 * sigma).all()
