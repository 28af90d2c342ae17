"""MTP speculation on the paged forward (`dsv4.runner.paged.speculative`): greedy output is token-identical to
non-speculative decoding, the drafts are the reference drafter's (same acceptance counts), and
forced acceptance (an oracle rewrites the drafts) exercises full, partial and zero acceptance —
rejected positions leave rows in the cache that must never be read. fp32 caches; eager steps
and static decode passes (what the CUDA graphs replay)."""

from __future__ import annotations

import zlib

import pytest

from dsv4.runner.paged.decode_graphs import GraphOptions
from dsv4.runner.paged.speculative import PagedSpeculator
from dsv4.speculative.acceptance import Draft
from tests.engine.conftest import greedy_request, make_core, run_to_completion
from tests.engine.test_speculative import (  # noqa: F401  (fixtures)
    NEW_TOKENS,
    make_spec_core,
    mtp_model,
    prompts,
    reference,
    sampled_outputs,
)
from tests.leak import assert_no_leaks

STATIC = GraphOptions(max_batch=4, max_model_len=2048, capture=False)


def paged_spec_core(model, k: int, graphs=None, **kw):
    return make_core(model, budget=kw.pop("budget", 64), paged={}, graphs=graphs,
                     spec_tokens=k, max_num_seqs=8, **kw)  # fmt: skip


def _run(core, model) -> dict[str, list[int]]:
    for rid, prompt in prompts(model.cfg.vocab_size).items():
        core.add_request(greedy_request(rid, prompt, NEW_TOKENS))
    return run_to_completion(core)


class OracleSpeculator(PagedSpeculator):
    """The real MTP drafts, then d_i := the reference token for the first c drafts and a wrong
    one after, c = hash(request, position) mod (k + 1)."""

    def __init__(self, real: PagedSpeculator, prompt_lens, ref) -> None:
        super().__init__(real.forward, real.sampler, real.k, real.graphs)
        self.prompt_lens, self.ref = prompt_lens, ref

    def _propose(self, *args) -> None:
        super()._propose(*args)
        for rid, (pos, draft) in list(self.drafts.items()):
            ref, first = self.ref[rid], pos - self.prompt_lens[rid]  # output index of t_P
            right = zlib.crc32(f"{rid}:{pos}".encode()) % (self.k + 1)
            toks = [ref[first + i] if first + i < len(ref) else 5 for i in range(1, self.k + 1)]
            toks = [t if i < right else (t + 1) % 1024 for i, t in enumerate(toks)]
            self.drafts[rid] = (pos, Draft(tuple(toks), draft.probs))


@pytest.mark.parametrize("graphs", [None, STATIC], ids=["eager", "static"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_paged_mtp_greedy_equals_reference(mtp_model, reference, k, graphs) -> None:  # noqa: F811
    core = paged_spec_core(mtp_model, k, graphs)
    assert isinstance(core.runner.forward.spec, PagedSpeculator)
    assert _run(core, mtp_model) == reference
    assert core.runner.spec_metrics.num_verify_steps > 0
    if graphs is not None:
        assert core.runner.forward.graphs.passes["target"].num_runs > 0
        assert core.runner.forward.graphs.passes["mtp"].num_runs > 0
    assert_no_leaks(core)


@pytest.mark.parametrize("graphs", [None, STATIC], ids=["eager", "static"])
@pytest.mark.parametrize("k", [1, 3])
def test_paged_drafts_are_the_reference_drafters(mtp_model, k, graphs) -> None:  # noqa: F811
    """Same model, same prompts: the paged speculator (MTP over the verified positions at the
    end of a step, draft steps on the cache) proposes exactly the reference drafter's tokens
    (MTP over per-request states at the start of the next step), for every request and
    position. Random weights reject nearly every draft, so this is what pins the drafts."""
    paged, ref = paged_spec_core(mtp_model, k, graphs), make_spec_core(mtp_model, k)
    seen_paged: dict[tuple[str, int], tuple[int, ...]] = {}
    seen_ref: dict[tuple[str, int], tuple[int, ...]] = {}
    spec, drafter = paged.runner.forward.spec, ref.runner.forward.spec.drafter
    propose_paged, propose_ref = spec._propose, drafter.propose

    def record_paged(*args):
        propose_paged(*args)
        seen_paged.update(((rid, pos), d.token_ids) for rid, (pos, d) in spec.drafts.items())

    def record_ref(jobs):
        drafts = propose_ref(jobs)
        for job, d in zip(jobs, drafts):
            seen_ref[(job.request.request_id, job.request.start_position)] = d.token_ids
        return drafts

    spec._propose, drafter.propose = record_paged, record_ref
    for core in (paged, ref):
        _run(core, mtp_model)
    assert len(seen_ref) > 20
    # The reference drafts only with a context (not on a request's first decode step) and
    # only as many as scheduled; the paged speculator proposes k at every step.
    for key, tokens in seen_ref.items():
        assert seen_paged[key][: len(tokens)] == tokens, key


@pytest.mark.parametrize("graphs", [None, STATIC], ids=["eager", "static"])
@pytest.mark.parametrize("k", [2, 3])
def test_paged_forced_acceptance_equals_reference(mtp_model, reference, k, graphs) -> None:  # noqa: F811
    core = paged_spec_core(mtp_model, k, graphs)
    lens = {rid: len(p) for rid, p in prompts(mtp_model.cfg.vocab_size).items()}
    core.runner.forward.spec = OracleSpeculator(core.runner.forward.spec, lens, reference)
    assert _run(core, mtp_model) == reference
    m = core.runner.spec_metrics
    assert 0 < m.num_accepted[0] < m.num_drafted[0]  # partial acceptance happened
    assert m.num_accepted[k - 1] > 0  # and full acceptance
    assert core.num_steps < 30
    assert_no_leaks(core)


def test_paged_preemption_keeps_outputs_exact(mtp_model) -> None:  # noqa: F811
    import torch

    from dsv4.model.generate import generate

    gen = torch.Generator().manual_seed(5)
    long_prompts = {
        f"p{i}": torch.randint(2, 1024, (120,), generator=gen).tolist() for i in range(3)
    }
    ref = {rid: generate(mtp_model, p, NEW_TOKENS) for rid, p in long_prompts.items()}
    core = paged_spec_core(mtp_model, 2, budget=512, num_blocks=25)
    core.runner.forward.spec = OracleSpeculator(
        core.runner.forward.spec, {r: 120 for r in long_prompts}, ref
    )
    preempted = []
    execute = core.runner.execute

    def spy(batch):
        preempted.extend(batch.preempted_request_ids)
        return execute(batch)

    core.runner.execute = spy
    for rid, prompt in long_prompts.items():
        core.add_request(greedy_request(rid, prompt, NEW_TOKENS))
    assert run_to_completion(core) == ref
    assert preempted
    assert_no_leaks(core)


def test_paged_sampled_speculation_is_seed_reproducible(mtp_model) -> None:  # noqa: F811
    first = sampled_outputs(paged_spec_core(mtp_model, 2, STATIC), mtp_model)
    assert first == sampled_outputs(paged_spec_core(mtp_model, 2, STATIC), mtp_model)
    assert all(len(v) == 6 for v in first.values())


def test_speculator_forgets_finished_requests(mtp_model) -> None:  # noqa: F811
    core = paged_spec_core(mtp_model, 2)
    _run(core, mtp_model)
    core.add_request(greedy_request("late", [3], 2))
    run_to_completion(core)
    assert set(core.runner.forward.spec.drafts) | set(core.runner.forward.spec.carry) <= {"late"}


@pytest.mark.gpu
def test_paged_mtp_with_captured_graphs_on_the_gpu() -> None:
    """CUDA graphs of the target (q = 1 + k) and both MTP passes, served formats, Triton: the
    graphs serve the steps and speculative greedy output stays close to plain greedy (bf16
    rounding of different GEMM shapes may flip a random-weight argmax; the exact equality is
    the CPU tests' job)."""
    import torch

    from dsv4.config.model import tiny_config
    from dsv4.model.tiny import random_model
    from kernels.backend import KernelBackendConfig

    model = random_model(tiny_config(), seed=5, dtype=torch.bfloat16, device="cuda")
    kernels = KernelBackendConfig(default="triton")
    gen = torch.Generator().manual_seed(2)
    plist = [torch.randint(2, 1024, (n,), generator=gen).tolist() for n in (1, 130, 300)]
    outs = []
    for k in (0, 2):
        core = make_core(model, kv="fp8", index="mxfp4", budget=512, paged={}, kernels=kernels,
                         graphs=GraphOptions(max_batch=4, max_model_len=1024), spec_tokens=k,
                         max_num_seqs=4)  # fmt: skip
        for i, p in enumerate(plist):
            core.add_request(greedy_request(f"r{i}", p, 12))
        outs.append(run_to_completion(core))
        passes = core.runner.forward.graphs.passes
        assert passes["target"].num_runs > 0
        if k:
            assert passes["mtp"].num_runs > 0 and passes["mtp_draft"].num_runs > 0
        assert_no_leaks(core)
    same = sum(a == b for r in outs[0] for a, b in zip(outs[0][r], outs[1][r]))
    assert same >= 0.75 * sum(len(v) for v in outs[0].values())
