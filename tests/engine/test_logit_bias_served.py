"""`logit_bias` through an engine on the tiny model, against the same requests without it.

An all-greedy batch: a plain request (keeps its plain tokens: the bias is per row), one with
+100 on a token (that token every step, prefill's first included), one with -100 on every
token its plain run chose (none of them comes back); on the reference forward, the paged
forward eagerly, on its static decode passes (CPU: `capture=False`, the captured graphs'
code) and with their in-graph argmax (`features.greedy_in_graph`, which must leave biased
rows to the sampler). A sampled batch: +100 forces the token too. Each run ends with the leak
check, the sampler's per-request biases included.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.scheduler.request import Request
from dsv4.types import SamplingParams
from tests.engine.conftest import TOKEN_PATHS, make_core, run_to_completion
from tests.leak import assert_no_leaks

NEW_TOKENS = 8
FORCED = 777


def _prompts(vocab: int) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(23)
    return [tuple(torch.randint(2, vocab, (m,), generator=gen).tolist()) for m in (5, 30, 12)]


def _run(model, forward: str, params: list[SamplingParams | None]) -> dict[str, list[int]]:
    core = make_core(model, budget=64, max_num_seqs=4, **TOKEN_PATHS[forward])
    for i, (prompt, p) in enumerate(zip(_prompts(model.cfg.vocab_size), params)):
        core.add_request(Request(f"r{i}", prompt, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                                 sampling_params=p))  # fmt: skip
    outputs = run_to_completion(core)
    core.add_request(Request("flush", (4, 5), max_new_tokens=1, eos_token_id=None))
    run_to_completion(core)  # its batch tells the runner which requests left
    assert_no_leaks(core, core.runner.sampler)
    return outputs


def _greedy(**more: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, **more)  # type: ignore[arg-type]


@pytest.mark.parametrize("forward", sorted(TOKEN_PATHS))
def test_a_bias_forces_or_bans_greedy_tokens_row_by_row(tiny, forward: str) -> None:
    plain = _run(tiny, forward, [None, _greedy(), _greedy()])
    assert all(FORCED not in tokens for tokens in plain.values())  # else +100 would prove less
    banned = tuple((t, -100.0) for t in sorted(set(plain["r2"])))
    biased = _run(tiny, forward, [None, _greedy(logit_bias=((FORCED, 100.0),)),
                                  _greedy(logit_bias=banned)])  # fmt: skip
    assert biased["r0"] == plain["r0"]
    assert biased["r1"] == [FORCED] * NEW_TOKENS
    assert len(biased["r2"]) == NEW_TOKENS and not set(biased["r2"]) & set(plain["r2"])


@pytest.mark.parametrize("forward", ["reference", "paged-graphs"])
def test_a_bias_forces_sampled_tokens(tiny, forward: str) -> None:
    """Seeded and unseeded rows (the sampler's two sampling paths); the plain row's draws
    are its own (per-request generator)."""

    def sampled(seed: int | None, **more: object) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=seed, max_new_tokens=NEW_TOKENS, **more)  # type: ignore[arg-type]

    plain = _run(tiny, forward, [sampled(9)])
    force = {"logit_bias": ((FORCED, 100.0),)}
    biased = _run(tiny, forward, [sampled(9), sampled(4, **force), sampled(None, **force)])
    assert biased["r0"] == plain["r0"] and FORCED not in plain["r0"]
    assert biased["r1"] == biased["r2"] == [FORCED] * NEW_TOKENS
