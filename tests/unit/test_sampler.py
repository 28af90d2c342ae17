"""Sampler: greedy, filters, per-request seeds independent of batch composition."""

from __future__ import annotations

import pytest
import torch

from dsv4.ops.sampling import SamplingSpec, filtered_probs
from dsv4.runner.sampler import Sampler


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


def test_batched_rows_follow_the_filtered_distribution_and_seeded_rows_stay_alone() -> None:
    """The batched device path (forced on CPU here; default on CUDA): unseeded rows are drawn
    together from the same filtered distribution as the row-by-row path, greedy rows stay the
    argmax, and a seeded row gives the same sequence as when it samples alone."""
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1, 1e-9], [0.1, 0.2, 0.3, 0.4]]))
    sampler = Sampler(default_seed=3, batched=True)
    spec = SamplingSpec(temperature=1.0, top_k=3)
    greedy, seeded = SamplingSpec(), SamplingSpec(temperature=1.0, seed=99)
    counts = torch.zeros(4)
    seq = []
    for _ in range(3000):
        a, g, s = sampler.sample(logits[[0, 1, 1]], ["a", "g", "s"], [spec, greedy, seeded])
        counts[a] += 1
        assert g == 3
        seq.append(s)
    freq = counts / 3000
    expected = torch.tensor([0.6, 0.3, 0.1, 0.0])
    sigma = (expected * (1 - expected) / 3000).sqrt()
    assert ((freq - expected).abs() <= 4 * sigma).all() and counts[3] == 0  # top-k 3 drops id 3
    alone = Sampler(batched=True)
    assert [alone.sample(logits[1:2], ["s"], [seeded])[0] for _ in range(3000)] == seq


def test_batched_sampling_is_reproducible_per_default_seed() -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    spec = SamplingSpec(temperature=0.8, top_p=0.9)

    def draws(seed: int) -> list[int]:
        sampler = Sampler(default_seed=seed, batched=True)
        return [t for _ in range(5) for t in sampler.sample(logits, list("abcd"), [spec] * 4)]

    assert draws(1) == draws(1) and draws(1) != draws(2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_rows_are_batched_on_the_device_and_follow_the_distribution() -> None:
    """On CUDA the default sampler batches unseeded rows (FlashInfer when installed, else
    batched torch): frequencies within 4 sigma of the filtered distribution."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1] + [0.0] * 129_276)
    logits = torch.log(probs.clamp_min(1e-30)).cuda().repeat(64, 1)
    sampler = Sampler(default_seed=5)
    spec = SamplingSpec(temperature=1.0, top_p=0.95)
    counts = torch.zeros(4)
    for _ in range(50):
        for token in sampler.sample(logits, [str(i) for i in range(64)], [spec] * 64):
            counts[token] += 1
    freq, n = counts / counts.sum(), 64 * 50
    kept = torch.tensor([0.5, 0.25, 0.15, 0.1])  # top-p 0.95 keeps all four
    assert ((freq - kept).abs() < 4 * (kept * (1 - kept) / n).sqrt()).all()
    assert sampler.num_live_generators == 0
