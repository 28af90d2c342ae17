"""`logprobs` through an engine on the tiny model, against the model's own logits.

A batch of a plain greedy request (no logprobs), a greedy one with 5 top logprobs, a seeded
sampled one with 0 (its token is drawn on the host after the step's copy) and an unseeded one
with 3: every token keeps the tokens the same requests get without logprobs, and its logprob
and top ones are the log_softmax of the model's logits at its position (teacher-forced
reference); the row without logprobs gets none. On the reference forward, the paged forward
eagerly, on its static decode passes (CPU: `capture=False`, the captured graphs' code) and with
their in-graph argmax (`features.greedy_in_graph`: a batch with logprobs must leave it for the
sampler's logits). Then P -> D (prefill-only, adopt, activate): P's first token's logprobs and
D's equal one engine's. Each run ends with the leak check.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from dsv4.engine.async_engine import AsyncEngine
from dsv4.scheduler.request import Request
from dsv4.types import SamplingParams, TokenLogprobs
from tests.engine.conftest import TOKEN_PATHS, make_core
from tests.leak import assert_no_leaks

NEW_TOKENS = 6
PLAIN = [
    None,
    SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS),
    SamplingParams(temperature=1.0, seed=11, max_new_tokens=NEW_TOKENS),
    SamplingParams(temperature=0.8, top_k=40, max_new_tokens=NEW_TOKENS),
]
ASKED = (None, 5, 0, 3)  # logprobs of each request above


def _prompts(vocab: int) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(29)
    return [tuple(torch.randint(2, vocab, (m,), generator=gen).tolist()) for m in (7, 30, 12, 5)]


def _with_logprobs(params: SamplingParams | None, n: int | None) -> SamplingParams | None:
    return params if n is None or params is None else dataclasses.replace(params, logprobs=n)


def _run(model, forward: str, params: list[SamplingParams | None]):
    """{request id: (tokens, logprobs)} and the core (its counters), leak-checked."""
    core = make_core(model, budget=64, max_num_seqs=4, **TOKEN_PATHS[forward])
    for i, (prompt, p) in enumerate(zip(_prompts(model.cfg.vocab_size), params)):
        core.add_request(Request(f"r{i}", prompt, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                                 sampling_params=p))  # fmt: skip
    outputs: dict[str, tuple[list[int], list[TokenLogprobs]]] = {}
    while core.has_work():
        for out in core.step():
            tokens, logprobs = outputs.setdefault(out.request_id, ([], []))
            assert not out.logprobs or len(out.logprobs) == len(out.new_token_ids)
            tokens.extend(out.new_token_ids)
            logprobs.extend(out.logprobs)
    core.add_request(Request("flush", (4, 5), max_new_tokens=1, eos_token_id=None))
    while core.has_work():
        core.step()  # its batch tells the runner which requests left
    assert_no_leaks(core, core.runner.sampler)
    return outputs, core


@torch.no_grad()
def _reference(model, prompt: tuple[int, ...], tokens: list[int]) -> list[torch.Tensor]:
    """[V] log_softmax of the model's logits before each token (fed the tokens themselves)."""
    state, ids, out = model.new_state(), torch.tensor(prompt), []
    for token in tokens:
        logits = model(ids, states=[state], last_only=True).logits[-1]
        out.append(torch.log_softmax(logits.float(), dim=-1))
        ids = torch.tensor([token])
    return out


def _assert_matches(reference: list[torch.Tensor], tokens: list[int],
                    logprobs: list[TokenLogprobs], n: int) -> None:  # fmt: skip
    assert len(logprobs) == len(tokens) == len(reference)
    for ref, token, entry in zip(reference, tokens, logprobs):
        assert entry.logprob == pytest.approx(float(ref[token]), abs=2e-4)
        assert len(entry.top) == n
        best = torch.topk(ref, n).values.tolist()
        assert [v for _, v in entry.top] == pytest.approx(best, abs=2e-4)  # best first
        assert all(float(ref[t]) == pytest.approx(v, abs=2e-4) for t, v in entry.top)


@pytest.mark.parametrize("forward", sorted(TOKEN_PATHS))
def test_logprobs_are_the_models_log_softmax_row_by_row(tiny, forward: str) -> None:
    plain, _ = _run(tiny, forward, PLAIN)
    asked, _ = _run(tiny, forward, [_with_logprobs(p, n) for p, n in zip(PLAIN, ASKED)])
    assert {rid: t for rid, (t, _) in asked.items()} == {rid: t for rid, (t, _) in plain.items()}
    assert asked["r0"][1] == [] and all(lp == [] for _, lp in plain.values())
    prompts = _prompts(tiny.cfg.vocab_size)
    for i, n in enumerate(ASKED):
        if n is not None:
            tokens, logprobs = asked[f"r{i}"]
            _assert_matches(_reference(tiny, prompts[i], tokens), tokens, logprobs, n)
    greedy = asked["r1"][1]
    assert all(e.logprob == e.top[0][1] for e in greedy)  # greedy: the most likely token


def test_the_in_graph_argmax_leaves_a_batch_with_logprobs_to_the_sampler(tiny) -> None:
    """All greedy: without logprobs the graph takes the decode steps' tokens; with one row
    asking, none (its logits go to the sampler), and the tokens stay the same."""
    greedy = PLAIN[1]
    plain, core = _run(tiny, "paged-greedy-in-graph", [None, greedy])
    assert core.runner.forward.num_greedy_in_graph >= NEW_TOKENS - 1
    asked, core = _run(tiny, "paged-greedy-in-graph", [None, _with_logprobs(greedy, 2)])
    assert core.runner.forward.num_greedy_in_graph == 0
    assert asked["r0"] == plain["r0"] and asked["r1"][0] == plain["r1"][0]
    tokens, logprobs = asked["r1"]
    prompt = _prompts(tiny.cfg.vocab_size)[1]
    _assert_matches(_reference(tiny, prompt, tokens), tokens, logprobs, 2)


def test_prefill_then_decode_equals_one_engine(tiny) -> None:
    """P samples the first token and its logprobs; D, adopting P's blocks, the rest: both as
    one engine (bit for bit: same forward, same KV)."""
    prompt = _prompts(tiny.cfg.vocab_size)[1]
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, logprobs=4)

    def request() -> Request:
        return Request("a", prompt, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                       sampling_params=params)  # fmt: skip

    async def colocated() -> list[TokenLogprobs]:
        engine = AsyncEngine(make_core(tiny), "one")
        engine.start()
        try:
            return [lp async for out in engine.generate(request()) for lp in out.logprobs]
        finally:
            await engine.stop()
            assert_no_leaks(engine.core)

    async def disaggregated() -> list[TokenLogprobs]:
        prefill, decode = AsyncEngine(make_core(tiny), "p"), AsyncEngine(make_core(tiny), "d")
        prefill.start()
        decode.start()
        try:
            outcome = await prefill.prefill(request())
            assert outcome.held is not None and outcome.first_token_logprobs is not None
            adopted = request()
            adopted.output_token_ids.append(outcome.first_token)
            dst = await decode.adopt(adopted)
            src_cache, dst_cache = prefill.core.runner.cache, decode.core.runner.cache
            for s, d in zip(outcome.held.block_ids, dst):
                dst_cache.backing[d] = src_cache.backing[s]
            assert await prefill.release_hold("a")
            rest = [lp async for out in decode.activate("a") for lp in out.logprobs]
            return [outcome.first_token_logprobs, *rest]
        finally:
            await prefill.stop()
            await decode.stop()
            assert_no_leaks(prefill.core, decode.core)

    one = asyncio.run(asyncio.wait_for(colocated(), 60))
    assert len(one) == NEW_TOKENS and all(len(e.top) == 4 for e in one)
    assert asyncio.run(asyncio.wait_for(disaggregated(), 60)) == one
