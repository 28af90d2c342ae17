"""The cached decode loop."""

from __future__ import annotations

import pytest
import torch

from dsv4.errors import InvalidRequest
from dsv4.model.generate import generate
from tests.model.conftest import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=8)


@torch.no_grad()
def test_greedy_equals_argmax_of_uncached_forward(model):
    prompt = list(range(5, 40))
    out = generate(model, prompt, max_new_tokens=6)
    logits = model(torch.tensor(prompt + out)).logits
    assert out == logits[len(prompt) - 1 : -1].argmax(-1).tolist()


def test_sampling_is_seeded_and_top_k_1_is_greedy(model):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    a = generate(model, prompt, 8, temperature=1.0, top_p=0.9, seed=123)
    b = generate(model, prompt, 8, temperature=1.0, top_p=0.9, seed=123)
    assert a == b and len(a) == 8
    assert generate(model, prompt, 5, temperature=0.7, top_k=1, seed=1) == generate(
        model, prompt, 5
    )


def test_stop_tokens_and_bad_requests(model):
    prompt = [7, 8, 9]
    greedy = generate(model, prompt, 4)
    assert (
        generate(model, prompt, 4, stop_token_ids=[greedy[1]])
        == greedy[: greedy.index(greedy[1]) + 1]
    )
    with pytest.raises(InvalidRequest):
        generate(model, [], 3)
    with pytest.raises(InvalidRequest):
        generate(model, prompt, 3, temperature=1.0, top_p=0.0)
