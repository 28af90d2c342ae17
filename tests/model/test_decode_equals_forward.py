"""Cached execution equals the full forward (docs/model.md#sequence-state).

Tiny config: window 32, C4 top-k 16, C128. Positions cross the window, every 4-token
boundary, the indexer's top-k saturation (> 64 tokens) and the first 128 boundary.
The tiny model's indexer has independent heads, so ReLU ties at 0 occur; our top-k breaks
them by entry index, which does not depend on chunking. Tolerance 2e-5 (fp32, logits ~5):
only matmul shapes differ between the runs.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.model.conftest import tiny_model

ATOL = 2e-5


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 1024, (300,), generator=torch.Generator().manual_seed(11))


@pytest.fixture(scope="module")
def full(model, ids):
    with torch.no_grad():
        return model(ids)


@torch.no_grad()
def test_decode_token_by_token_equals_full_forward(model, ids, full):
    state = model.new_state()
    steps = [model(ids[i : i + 1], states=[state]).logits for i in range(140)]
    torch.testing.assert_close(torch.cat(steps), full.logits[:140], atol=ATOL, rtol=0)
    assert state.num_tokens == 140
    assert state.layers[2].compressor.num_entries == 1  # C128: one window complete at 127
    assert state.layers[2].compressor.pending_kv.shape[0] == 140 - 128
    assert state.layers[1].compressor.num_entries == 35
    assert state.layers[0].window.shape[0] == model.cfg.sliding_window - 1


@pytest.mark.parametrize(
    "bounds",
    [
        (0, 1, 5, 127, 128, 133, 256, 257, 300),
        (0, 3, 130, 131, 259, 300),
        (0, 200, 300),
    ],
)
@torch.no_grad()
def test_chunked_prefill_equals_one_shot(model, ids, full, bounds):
    state = model.new_state()
    chunks = [model(ids[a:b], states=[state]) for a, b in itertools.pairwise(bounds)]
    torch.testing.assert_close(
        torch.cat([c.logits for c in chunks]), full.logits, atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        torch.cat([c.streams for c in chunks]), full.streams, atol=ATOL, rtol=0
    )


@torch.no_grad()
def test_prefix_state_reuse_and_batched_rows(model, ids, full):
    """A cloned prefix state continues two different ways; two rows of a batch, each with its
    own state, equal the single-row runs."""
    prefix = model.new_state()
    model(ids[:150], states=[prefix])
    a, b = prefix.clone(), prefix.clone()
    other = torch.randint(0, 1024, (20,), generator=torch.Generator().manual_seed(5))
    batch = torch.stack((ids[150:170], other))
    out = model(batch, states=[a, b])
    torch.testing.assert_close(out.logits[0], full.logits[150:170], atol=ATOL, rtol=0)
    solo = model(other, states=[prefix])
    torch.testing.assert_close(out.logits[1], solo.logits, atol=ATOL, rtol=0)


def test_positions_must_continue_the_state(model, ids):
    state = model.new_state()
    with torch.no_grad():
        model(ids[:10], states=[state])
        with pytest.raises(ValueError):
            model(ids[10:12], positions=torch.tensor([11, 12]), states=[state])
