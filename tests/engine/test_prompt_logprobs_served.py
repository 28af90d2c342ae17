"""`prompt_logprobs` through an engine on the tiny model, against the model's own logits.

A batch of a 40-token prompt asking 3 top logprobs (and generation logprobs), a 13-token one
asking 0, a one-token prompt asking 5 (nothing to predict: no positions) and a plain request:
each asking request gets its prompt's logprobs once, with its first token, and each position
p's entry is the teacher-forced log_softmax of the model's logits at p - 1 (one full forward
over the prompt) at the prompt token, its rank and the N most likely tokens; the tokens stay
those of the same requests without prompt logprobs. On the reference and the paged forward,
the prompt in one prefill step and chunked (`max_num_batched_tokens` 16: chunk boundaries
inside the prompts), the head run in slices of 8 rows (`HEAD_ROWS`). Then P -> D: P's prompt
logprobs equal one engine's; a speculating engine refuses them (a speculating decode worker
adopts such a request: P computed them). Each run ends with the leak check.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from dsv4.config.model import tiny_config
from dsv4.engine.async_engine import AsyncEngine
from dsv4.errors import InvalidRequest
from dsv4.model.tiny import random_model
from dsv4.runner import prompt_logprobs
from dsv4.scheduler.request import Request
from dsv4.types import PromptLogprobs, SamplingParams
from tests.engine.conftest import TOKEN_PATHS, make_core
from tests.leak import assert_no_leaks

NEW_TOKENS = 3
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
ASKED = {  # request -> (prompt length, its sampling with prompt logprobs)
    "long": (40, dataclasses.replace(GREEDY, prompt_logprobs=3, logprobs=2)),
    "short": (13, SamplingParams(temperature=0.9, seed=7, max_new_tokens=3, prompt_logprobs=0)),
    "one": (1, dataclasses.replace(GREEDY, prompt_logprobs=5)),
    "plain": (9, GREEDY),
}


def _prompts(vocab: int) -> dict[str, tuple[int, ...]]:
    gen = torch.Generator().manual_seed(41)
    return {rid: tuple(torch.randint(2, vocab, (m,), generator=gen).tolist())
            for rid, (m, _) in ASKED.items()}  # fmt: skip


def _run(model, forward: str, budget: int, asked: bool):
    """{request id: tokens}, {request id: its prompt logprobs}; leak-checked."""
    core = make_core(model, budget=budget, max_num_seqs=4, **TOKEN_PATHS[forward])
    for rid, prompt in _prompts(model.cfg.vocab_size).items():
        params = ASKED[rid][1]
        params = params if asked else dataclasses.replace(params, prompt_logprobs=None)
        core.add_request(Request(rid, prompt, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                                 sampling_params=params))  # fmt: skip
    tokens: dict[str, list[int]] = {}
    prompts: dict[str, PromptLogprobs] = {}
    while core.has_work():
        for out in core.step():
            is_first = out.request_id not in tokens
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.prompt_logprobs is not None:  # once, with the first token
                assert is_first and out.request_id not in prompts
                prompts[out.request_id] = out.prompt_logprobs
    core.add_request(Request("flush", (4, 5), max_new_tokens=1, eos_token_id=None))
    while core.has_work():
        core.step()  # its batch tells the runner which requests left (their generators)
    assert_no_leaks(core, core.runner.sampler)
    return tokens, prompts


@torch.no_grad()
def _assert_teacher_forced(model, prompt: tuple[int, ...], got: PromptLogprobs, n: int) -> None:
    assert got.token_ids == prompt and len(got.positions) == len(prompt) - 1
    reference = torch.log_softmax(model(torch.tensor(prompt)).logits.float(), dim=-1)  # [S, V]
    for p, entry in enumerate(got.positions, start=1):
        row, token = reference[p - 1], prompt[p]  # the logits before position p
        assert entry.logprob == pytest.approx(float(row[token]), abs=2e-4)
        assert entry.rank == int((row >= row[token]).sum())
        values = torch.topk(row, n).values
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=2e-4)
        assert all(float(row[t]) == pytest.approx(v, abs=2e-4) for t, v in entry.top)


@pytest.mark.parametrize("budget", [64, 16], ids=["whole", "chunked"])
@pytest.mark.parametrize("forward", ["reference", "paged"])
def test_prompt_logprobs_are_the_models_teacher_forced_log_softmax(
    tiny, monkeypatch, forward: str, budget: int
) -> None:
    monkeypatch.setattr(prompt_logprobs, "HEAD_ROWS", 8)  # a 40-row chunk: 5 head slices
    plain, none_asked = _run(tiny, forward, budget, asked=False)
    tokens, prompts = _run(tiny, forward, budget, asked=True)
    assert tokens == plain and not none_asked and set(prompts) == {"long", "short", "one"}
    for rid, prompt in _prompts(tiny.cfg.vocab_size).items():
        if rid in prompts:
            n = ASKED[rid][1].prompt_logprobs
            _assert_teacher_forced(tiny, prompt, prompts[rid], n)
    assert prompts["one"].positions == ()


def test_prefill_worker_prompt_logprobs_equal_one_engines(tiny) -> None:
    prompt = _prompts(tiny.cfg.vocab_size)["long"]
    params = ASKED["long"][1]

    def request() -> Request:
        return Request("a", prompt, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                       sampling_params=params)  # fmt: skip

    async def both() -> tuple[PromptLogprobs | None, PromptLogprobs | None]:
        one, prefill = AsyncEngine(make_core(tiny), "one"), AsyncEngine(make_core(tiny), "p")
        one.start()
        prefill.start()
        try:
            outs = [out async for out in one.generate(request())]
            outcome = await prefill.prefill(request())
            assert await prefill.release_hold("a")
            return outs[0].prompt_logprobs, outcome.prompt_logprobs
        finally:
            await one.stop()
            await prefill.stop()
            assert_no_leaks(one.core, prefill.core)

    colocated, disaggregated = asyncio.run(asyncio.wait_for(both(), 60))
    assert colocated is not None and len(colocated.positions) == len(prompt) - 1
    assert disaggregated == colocated


def test_a_speculating_engine_refuses_prompt_logprobs_but_decodes_after_p() -> None:
    model = random_model(tiny_config(), seed=3)  # has its MTP layer
    speculating = make_core(model, spec_tokens=2)
    asked = dataclasses.replace(GREEDY, prompt_logprobs=0)
    with pytest.raises(InvalidRequest, match=r"does not support prompt_logprobs;"):
        speculating.add_request(Request("p", (1, 2, 3), max_new_tokens=2, sampling_params=asked))
    adopted = Request("d", (1, 2, 3), max_new_tokens=2, sampling_params=asked)
    adopted.output_token_ids.append(7)  # P computed the prompt and its logprobs
    assert speculating.adopt(adopted)
    speculating.abandon("d")
    assert_no_leaks(speculating)
