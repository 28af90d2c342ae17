"""MTP speculative decoding in the engine: greedy output is token-identical to the reference
(non-speculative) decode for k = 1, 2, 3, with chunked prefill and mixed prompt lengths.

Random weights make the MTP layer's drafts almost always wrong, so besides the real drafter
an oracle drafter (the real one, then its tokens overwritten by a deterministic mix of the
reference continuation and wrong tokens) drives full, partial and zero acceptance, i.e. both
rollback paths (truncate and replay).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from dsv4.cache.packing import CacheOptions
from dsv4.config.model import tiny_config
from dsv4.engine.core import EngineCore, EngineOptions, build_engine_core
from dsv4.model.generate import generate
from dsv4.model.tiny import random_model
from dsv4.scheduler.config import SchedulerConfig
from dsv4.speculative.acceptance import Draft
from tests.engine.conftest import greedy_request, run_to_completion
from tests.leak import assert_no_leaks

PROMPT_LENS = (1, 7, 130, 45)
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def mtp_model():
    return random_model(tiny_config(), seed=3)


def prompts(vocab: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(11)
    return {
        f"r{i}": torch.randint(2, vocab, (n,), generator=gen).tolist()
        for i, n in enumerate(PROMPT_LENS)
    }


@pytest.fixture(scope="module")
def reference(mtp_model) -> dict[str, list[int]]:
    vocab = mtp_model.cfg.vocab_size
    return {rid: generate(mtp_model, p, NEW_TOKENS) for rid, p in prompts(vocab).items()}


def make_spec_core(model, k: int, budget: int = 64, num_blocks: int = 64) -> EngineCore:
    options = CacheOptions(block_size=128, kv_dtype="fp32", index_dtype="fp32",
                           num_speculative_tokens=k)  # fmt: skip
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=2048,
                          num_speculative_tokens=k)  # fmt: skip
    return build_engine_core(model, EngineOptions(options, cfg, num_blocks))


class OracleDrafter:
    """The real MTP drafter, then d_i := reference token for the first c drafts and a wrong
    token after, c = hash(request, position) mod (k + 1)."""

    def __init__(self, real, prompt_lens: dict[str, int], reference: dict[str, list[int]]):
        self.real, self.prompt_lens, self.reference = real, prompt_lens, reference

    def propose(self, jobs):
        drafts = self.real.propose(jobs)
        out = []
        for job, draft in zip(jobs, drafts):
            rid, pos = job.request.request_id, job.request.start_position
            ref = self.reference[rid]
            first = pos - self.prompt_lens[rid]  # output index of t_P
            num_right = zlib.crc32(f"{rid}:{pos}".encode()) % (job.num_drafts + 1)
            tokens = []
            for i in range(1, job.num_drafts + 1):
                right = ref[first + i] if first + i < len(ref) else 5
                tokens.append(right if i <= num_right else (right + 1) % 1024)
            out.append(Draft(tuple(tokens), draft.probs))
        return out


def _run(core, model) -> dict[str, list[int]]:
    for rid, prompt in prompts(model.cfg.vocab_size).items():
        core.add_request(greedy_request(rid, prompt, NEW_TOKENS))
    return run_to_completion(core)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_greedy_equals_reference(mtp_model, reference, k: int) -> None:
    core = make_spec_core(mtp_model, k)
    assert _run(core, mtp_model) == reference
    metrics = core.runner.spec_metrics
    assert metrics.num_verify_steps > 0 and sum(metrics.num_drafted) > 0
    # Finished ids reach the runner with the next batch: after one more request, only its
    # own context may be left.
    core.add_request(greedy_request("late", [3], 2))
    run_to_completion(core)
    assert set(core.runner.forward.spec.contexts) <= {"late"}
    assert_no_leaks(core)


@pytest.mark.parametrize("k", [2, 3])
def test_forced_acceptance_equals_reference(mtp_model, reference, k: int) -> None:
    core = make_spec_core(mtp_model, k)
    lens = {rid: len(p) for rid, p in prompts(mtp_model.cfg.vocab_size).items()}
    spec = core.runner.forward.spec
    spec.drafter = OracleDrafter(spec.drafter, lens, reference)
    assert _run(core, mtp_model) == reference
    m = core.runner.spec_metrics
    assert 0 < m.num_accepted[0] < m.num_drafted[0]  # partial acceptance happened
    assert m.num_accepted[k - 1] > 0  # and full acceptance
    assert core.num_steps < 30  # fewer steps than one token per step would take
    assert_no_leaks(core)


def _record_batches(core: EngineCore) -> list:
    batches, execute = [], core.runner.execute

    def spy(batch, _execute=execute):
        batches.append(batch)
        return _execute(batch)

    core.runner.execute = spy
    return batches


@pytest.mark.parametrize(("mode", "first_chunk"), [("adaptive", 256 - 3), ("static", 256 - 3 * 8)])
def test_lone_long_prompt_gets_the_prefill_budget_end_to_end(mtp_model, mode, first_chunk):
    """#51725 through the engine: with k = 3 and 8 seqs, static reserves 24 draft tokens of the
    256 even for one request; adaptive only this request's 3."""
    options = CacheOptions(block_size=128, kv_dtype="fp32", index_dtype="fp32",
                           num_speculative_tokens=3)  # fmt: skip
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=2048,
                          num_speculative_tokens=3, spec_budget=mode)  # fmt: skip
    core = build_engine_core(mtp_model, EngineOptions(options, cfg, 16))
    batches = _record_batches(core)
    prompt = prompts(mtp_model.cfg.vocab_size)["r2"] * 3  # 390 tokens
    core.add_request(greedy_request("long", prompt, 3))
    outputs = run_to_completion(core)
    assert batches[0].requests[0].num_tokens == first_chunk
    assert len(outputs["long"]) == 3
    assert_no_leaks(core)


def sampled_outputs(core, model) -> dict[str, list[int]]:
    """Every prompt sampled (T 0.8, top-k 50, its own seed) to 6 tokens with speculation."""
    from dsv4.scheduler.request import Request
    from dsv4.types import SamplingParams

    for i, (rid, prompt) in enumerate(prompts(model.cfg.vocab_size).items()):
        spec = SamplingParams(temperature=0.8, top_k=50, seed=100 + i)
        core.add_request(Request(rid, tuple(prompt), 6, spec, eos_token_id=None))
    outputs = run_to_completion(core)
    assert core.runner.spec_metrics.num_verify_steps > 0
    assert_no_leaks(core)
    return outputs


def test_sampled_speculation_is_seed_reproducible(mtp_model) -> None:
    first = sampled_outputs(make_spec_core(mtp_model, 2), mtp_model)
    assert first == sampled_outputs(make_spec_core(mtp_model, 2), mtp_model)
    assert all(len(v) == 6 for v in first.values())


def test_preemption_and_lost_contexts_keep_outputs_exact(mtp_model) -> None:
    """Three 120-token prompts in 25 blocks (8 each): crossing the 128-token block boundary
    while decoding preempts one (recompute: its MTP context restarts). Contexts are also
    dropped every 4th step (as after a P->D hand-off: no target streams), so that step
    drafts nothing. Outputs stay equal to the reference."""
    gen = torch.Generator().manual_seed(5)
    long_prompts = {
        f"p{i}": torch.randint(2, 1024, (120,), generator=gen).tolist() for i in range(3)
    }
    reference = {rid: generate(mtp_model, p, NEW_TOKENS) for rid, p in long_prompts.items()}
    core = make_spec_core(mtp_model, 2, budget=512, num_blocks=25)
    spec = core.runner.forward.spec
    spec.drafter = OracleDrafter(spec.drafter, {r: 120 for r in long_prompts}, reference)
    batches = _record_batches(core)
    for rid, prompt in long_prompts.items():
        core.add_request(greedy_request(rid, prompt, NEW_TOKENS))
    outputs: dict[str, list[int]] = {}
    for step in range(200):
        if not core.has_work():
            break
        if step % 4 == 3:
            spec.contexts.clear()
        for out in core.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert outputs == reference
    assert any(b.preempted_request_ids for b in batches)
    assert_no_leaks(core)
