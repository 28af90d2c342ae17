"""Random models with skewed routing (`random_model(routing="zipf1")`, `dsv4.model.skew`):
expert popularity per MoE layer close to 1/rank on random inputs; "uniform" stays the default."""

from __future__ import annotations

import pytest
import torch

from dsv4.config.model import tiny_config
from dsv4.model.skew import zipf_expected_counts, zipf_layer_ranks, zipf_share
from dsv4.model.tiny import random_model
from dsv4.runner.routing_stats import RoutingStats
from dsv4.serving.expert_metrics import top_share

# enough experts for a "top 10%" (7 of 64); layer 0 is hash-routed, layers 1-3 scored
CFG = tiny_config().with_overrides(n_routed_experts=64, num_experts_per_tok=2,
                                   num_nextn_predict_layers=0)  # fmt: skip


def counted(routing: str | None) -> list[list[int]]:
    """Each layer's routed selections per expert on 512 random tokens."""
    kwargs = {} if routing is None else {"routing": routing}
    model = random_model(CFG, seed=1, **kwargs)
    stats = RoutingStats.for_model(model, first_scratch_block=0)
    stats.observe(model)
    ids = torch.randint(1, CFG.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
    return stats.snapshot()


def popularity(routing: str | None) -> list[float]:
    """Top-10% share of each layer's selections on 512 random tokens."""
    return [top_share(row) for row in counted(routing)]


def test_expected_counts_name_the_experts_the_skewed_gates_pick_most() -> None:
    """A benchmark keeps the popular experts resident before the model exists: the expected
    counts of `zipf_layer_ranks` (seed 1, as the model) agree with what the gates select."""
    ranks = zipf_layer_ranks(CFG.num_hidden_layers, CFG.n_routed_experts, seed=1)
    for layer, (row, r) in enumerate(zip(counted("zipf1"), ranks)):
        expected = zipf_expected_counts(r)
        top_expected = set(sorted(range(64), key=lambda e: -expected[e])[:7])
        top_counted = set(sorted(range(64), key=lambda e: -row[e])[:7])
        assert len(top_expected & top_counted) >= 4, (layer, top_expected, top_counted)
        assert sum(expected) == pytest.approx(1_000_000, abs=64)


def test_zipf1_routing_is_skewed_like_one_over_rank() -> None:
    shares = popularity("zipf1")
    ideal = zipf_share(64, 7)  # 0.55: what the 7 most popular of 64 take under 1/rank
    assert all(0.4 < s < ideal + 0.1 for s in shares), (shares, ideal)
    assert all(s < 0.35 for s in popularity(None)), "random gates route near uniformly"


def test_uniform_is_the_default_and_keeps_the_draws() -> None:
    default, uniform = random_model(CFG, seed=1), random_model(CFG, seed=1, routing="uniform")
    skewed = random_model(CFG, seed=1, routing="zipf1")
    for a, b, c in zip(default.layers, uniform.layers, skewed.layers):
        ga, gb, gc = a.ffn.gate, b.ffn.gate, c.ffn.gate
        if ga.is_hash:
            assert torch.equal(ga.tid2eid, gb.tid2eid) and not torch.equal(ga.tid2eid, gc.tid2eid)
        else:
            assert torch.equal(ga.bias, gb.bias) and not torch.equal(ga.bias, gc.bias)
        assert torch.equal(ga.weight, gc.weight)  # only the router's selection changes
    with pytest.raises(ValueError, match="uniform or zipf1"):
        random_model(CFG, routing="zipf2")
