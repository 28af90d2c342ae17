"""Zipf routing (`dsv4.model.skew`) draws its scale and hash tables from a second generator
seeded from model.seed: the largest allowed seed (2**64 - 1) must not overflow it."""

from __future__ import annotations

import torch

from dsv4.config.model import tiny_config
from dsv4.config.sections import SEED_LIMIT
from dsv4.model.tiny import random_model

CFG = tiny_config().with_overrides(num_nextn_predict_layers=0)


def _gate_state(seed: int) -> list[torch.Tensor]:
    model = random_model(CFG, seed=seed, routing="zipf1")
    return [t.clone() for name, t in model.state_dict().items() if ".gate." in name]


def test_zipf_routing_takes_the_largest_seed() -> None:
    first, again = _gate_state(SEED_LIMIT - 1), _gate_state(SEED_LIMIT - 1)
    assert first and all(torch.equal(a, b) for a, b in zip(first, again))  # deterministic
    assert not all(torch.equal(a, b) for a, b in zip(first, _gate_state(0)))
