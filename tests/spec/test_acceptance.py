"""Acceptance rules: greedy is exact; rejection sampling preserves the target distribution."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from dsv4.ops.sampling import SamplingSpec
from dsv4.runner.sampler import RequestRandom, Sampler
from dsv4.speculative.acceptance import accept_greedy, accept_sampled, residual_probs
from dsv4.speculative.metrics import SpecMetrics

# Hand-built target p_0, p_1, p_2 and draft q_1, q_2 over a 5-token vocabulary; q differs
# from p a lot (and puts mass where p has none) so both branches are exercised.
P = torch.tensor(
    [[0.50, 0.20, 0.15, 0.10, 0.05], [0.05, 0.05, 0.60, 0.30, 0.00], [0.2, 0.2, 0.2, 0.2, 0.2]]
)
Q = torch.tensor([[0.10, 0.40, 0.10, 0.10, 0.30], [0.25, 0.25, 0.25, 0.00, 0.25]])


def test_greedy_accepts_the_matching_prefix_then_the_target_token() -> None:
    assert accept_greedy((4, 5, 6), (4, 5, 6, 7)) == (4, 5, 6, 7)  # all + bonus
    assert accept_greedy((4, 9, 6), (4, 5, 6, 7)) == (4, 5)  # stop at the first mismatch
    assert accept_greedy((9,), (4, 5)) == (4,)
    assert accept_greedy((), (3,)) == (3,)
    with pytest.raises(ValueError):
        accept_greedy((1, 2), (1, 2))


def test_residual_is_the_normalised_positive_part() -> None:
    r = residual_probs(P[0], Q[0])
    torch.testing.assert_close(r, torch.tensor([0.4, 0.0, 0.05, 0.0, 0.0]) / 0.45)
    torch.testing.assert_close(residual_probs(P[2], P[2]), P[2])  # p == q: fall back to p


def _within_4_sigma(counts: Counter, total: int, probs: torch.Tensor) -> None:
    for token, p in enumerate(probs.tolist()):
        expected = total * p
        sigma = math.sqrt(max(total * p * (1 - p), 1e-9))
        assert abs(counts[token] - expected) <= 4 * sigma + 1, (token, counts[token], expected)


def test_rejection_sampling_preserves_the_target_distribution() -> None:
    """4000 seeded rounds with k = 2 drafts drawn from q: the first emitted token follows
    p_0, the second (when emitted) p_1, and d_1 is accepted with prob sum min(p_0, q_1)."""
    sampler = Sampler()
    rng = RequestRandom(sampler, "r", SamplingSpec(temperature=1.0, seed=1234))
    first, second = Counter(), Counter()
    num_rounds = num_second = num_accepted = 0
    for _ in range(4000):
        drafts = (rng.categorical(Q[0]), rng.categorical(Q[1]))
        out = accept_sampled(drafts, Q, P, rng)
        num_rounds += 1
        first[out[0]] += 1
        num_accepted += len(out) > 1
        if len(out) > 1:
            second[out[1]] += 1
            num_second += 1
    _within_4_sigma(first, num_rounds, P[0])
    _within_4_sigma(second, num_second, P[1])
    rate = float(torch.minimum(P[0], Q[0]).sum())  # 0.55
    assert abs(num_accepted / num_rounds - rate) <= 4 * math.sqrt(rate * (1 - rate) / 4000)


def test_sampled_acceptance_is_seed_reproducible() -> None:
    def run(seed: int) -> list[tuple[int, ...]]:
        rng = RequestRandom(Sampler(), "r", SamplingSpec(temperature=1.0, seed=seed))
        return [accept_sampled((1, 3), Q, P, rng) for _ in range(50)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_metrics_count_per_position() -> None:
    m = SpecMetrics(3)
    m.record(3, 3)
    m.record(3, 1)
    m.record(2, 0)
    m.record(0, 0)  # no drafts: not a verify step with drafts
    assert m.num_drafted == [3, 3, 2] and m.num_accepted == [2, 1, 1]
    assert m.acceptance_rates == pytest.approx([2 / 3, 1 / 3, 0.5])
    assert m.mean_tokens_per_step == pytest.approx(1 + 4 / 3)
