"""The paged forward (flat batch on the packed cache, through the kernel ops) against the
reference forward (per-request states) and the reference model.

fp32 model and fp32 caches make every cache round trip lossless, so the paged path must give
the same greedy tokens; bf16 runs compare logits within the bf16 tolerance (batched and
per-row bf16 GEMMs round differently)."""

from __future__ import annotations

import pytest
import torch

from dsv4.config.index_pattern import IndexPattern
from dsv4.config.model import tiny_config
from dsv4.model.generate import generate
from dsv4.model.tiny import random_model
from dsv4.runner.paged import MetadataSwitches, PagedSwitches
from dsv4.scheduler.batch import RequestStepOutput, StepOutput
from kernels.backend import KernelBackendConfig
from tests.engine.conftest import greedy_request, make_core, run_to_completion
from tests.engine.test_engine_core import NEW_TOKENS, prompts
from tests.leak import assert_no_leaks

PAGED = {}  # default switches


@pytest.fixture(scope="module")
def reference(tiny) -> dict[str, list[int]]:
    """The reference model's cached greedy decode of every prompt."""
    return {rid: generate(tiny, p, NEW_TOKENS) for rid, p in prompts(tiny.cfg.vocab_size).items()}


def run(core, model) -> dict[str, list[int]]:
    for rid, prompt in prompts(model.cfg.vocab_size).items():
        core.add_request(greedy_request(rid, prompt, NEW_TOKENS))
    out = run_to_completion(core)
    assert_no_leaks(core)
    return out


@pytest.mark.parametrize(
    "budget,plan", [(4096, "area"), (64, "area"), (97, "fixed")],
    ids=["one-chunk", "chunks-64", "chunks-97-fixed"],
)  # fmt: skip
def test_paged_greedy_equals_reference(tiny, reference, budget: int, plan: str) -> None:
    """Mixed steps (decodes + prefill chunks of several requests), both chunk planners."""
    core = make_core(tiny, budget=budget, prefill_chunk_plan=plan, paged=PAGED)
    assert run(core, tiny) == reference


@pytest.mark.parametrize(
    "metadata,switches,fused",
    [
        (MetadataSwitches(shared=False), PagedSwitches(), True),
        (MetadataSwitches(cached_token_to_req=False, skip_redundant_fill=False), PagedSwitches(), True),
        (MetadataSwitches(), PagedSwitches(skip_topk=False, compressor_boundary_only=False), True),
        (MetadataSwitches(), PagedSwitches(), False),
        (MetadataSwitches(), PagedSwitches(fuse_shared_expert=True), True),
        (MetadataSwitches(), PagedSwitches(attention_all_heads=True, indexer_variants=True), True),
    ],
    ids=["metadata-per-layer", "t2r-per-builder+prefill", "no-skip-topk", "unfused-first-mhc",
         "fused-shared-expert", "issue25-variants"],
)  # fmt: skip
def test_paged_switches_keep_outputs(tiny, reference, metadata, switches, fused) -> None:
    """Every switch of the paged path off (its baseline), and the shared expert fused into the
    grouped GEMM, give the same tokens."""
    tiny.fuse_first_hc = fused
    try:
        core = make_core(tiny, budget=64, paged={"metadata": metadata, "switches": switches})
        assert run(core, tiny) == reference
    finally:
        tiny.fuse_first_hc = True


def test_paged_preemption_resumes_with_same_tokens(tiny, reference) -> None:
    core = make_core(tiny, budget=512, num_blocks=9, paged=PAGED)
    assert run(core, tiny) == reference


def test_paged_index_cache_equals_reference_index_cache(tiny) -> None:
    """IndexCache frequency 2 on both paths: Shared C4 layers reuse the Full layer's top-k."""
    pattern = IndexPattern.from_freq(tiny.cfg, 2)
    tiny.set_index_pattern(pattern)
    try:
        ref = run(make_core(tiny, budget=64, index_pattern=pattern.roles), tiny)
        paged = run(make_core(tiny, budget=64, index_pattern=pattern.roles, paged=PAGED), tiny)
    finally:
        tiny.set_index_pattern(IndexPattern.all_full(tiny.cfg))
    assert paged == ref


def _lockstep_logits(*cores) -> list[list[torch.Tensor]]:
    """Drive cores by hand on the same tokens: every step's sampling-row logits of each core;
    the first core's greedy tokens are fed to all, so their inputs never diverge."""
    steps = []
    while cores[0].has_work():
        batches = [c.scheduler.schedule() for c in cores]
        logits = [c.runner.forward.paged(b).logits for c, b in zip(cores, batches)]
        steps.append(logits)
        rows = [r.request_id for r in batches[0].requests if r.samples_token]
        given = dict(zip(rows, logits[0].argmax(-1).tolist()))
        for core, batch in zip(cores, batches):
            core.scheduler.update(StepOutput(tuple(
                RequestStepOutput(r.request_id, (given[r.request_id],) if r.request_id in given else ())
                for r in batch.requests
            )))  # fmt: skip
    return steps


@pytest.mark.slow
def test_paged_triton_kernels_match_reference_ops() -> None:
    """The same paged steps with every op on its Triton kernel (interpreter on CPU) and on its
    torch reference: bf16 model and caches, a short run that crosses the C4 top-k and a C128
    window boundary, both fed the same tokens. Three layers: the tiny model's fourth repeats
    C4 (the interpreter's time goes with the layers)."""
    cfg = tiny_config().with_overrides(
        num_nextn_predict_layers=0, num_hidden_layers=3, compress_ratios=(0, 4, 128)
    )
    model = random_model(cfg, seed=5, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(2, cfg.vocab_size, (130,), generator=gen).tolist()
    cores = []
    for backend in ("ref", "triton"):
        core = make_core(model, kv="bf16", index="bf16", budget=80, paged=PAGED,
                         kernels=KernelBackendConfig(default=backend), max_num_seqs=4)  # fmt: skip
        core.add_request(greedy_request("a", prompt, 4))
        cores.append(core)
    steps = [s for s in _lockstep_logits(*cores) if s[0].numel()]
    assert len(steps) == 4
    for ref, tri in steps:
        assert (ref - tri).abs().max() < 0.06 * ref.abs().max()
    for core in cores:
        assert_no_leaks(core)


@pytest.mark.slow
def test_paged_issue25_variants_match_default_kernels() -> None:
    """fp8 KV rows and MXFP4 indexer keys, every op on its Triton kernel (interpreter on CPU):
    the all-heads decode attention and the indexer variants switched on against the default
    kernels, fed the same tokens through C4 top-k steps (more entries than k)."""
    # Two layers (the hash-routed window layer, one C4 layer) and 44 tokens (11 entries for
    # k = 4): the interpreter's time goes with both.
    cfg = tiny_config().with_overrides(
        num_nextn_predict_layers=0, index_topk=4, num_hidden_layers=2, compress_ratios=(0, 4)
    )
    model = random_model(cfg, seed=5, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(2, cfg.vocab_size, (44,), generator=gen).tolist()
    cores = []
    for on in (False, True):
        switches = PagedSwitches(attention_all_heads=on, indexer_variants=on)
        core = make_core(model, kv="fp8", index="mxfp4", budget=80, max_num_seqs=4,
                         paged={"switches": switches},
                         kernels=KernelBackendConfig(default="triton"))  # fmt: skip
        core.add_request(greedy_request("a", prompt, 3))
        cores.append(core)
    steps = [s for s in _lockstep_logits(*cores) if s[0].numel()]
    assert len(steps) == 3
    for off, on in steps:
        assert (off - on).abs().max() < 0.02 * off.abs().max()
    for core in cores:
        assert_no_leaks(core)


def test_paged_bf16_logits_stay_close_to_reference(tiny) -> None:
    """bf16 model and bf16 caches: the paged and reference forwards agree within bf16 noise."""
    model = random_model(tiny.cfg, seed=3, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(2, tiny.cfg.vocab_size, (300,), generator=gen)
    core = make_core(model, kv="bf16", index="bf16", budget=97, paged=PAGED)
    core.add_request(greedy_request("a", prompt.tolist(), 1))
    paged = _lockstep_logits(core)[-1][0][0]
    ref = model(prompt[None]).logits[0, -1]
    assert (paged - ref).abs().max() < 0.05 * ref.abs().max()
    assert_no_leaks(core)


@pytest.mark.gpu
def test_paged_gpu_kernels_match_reference_ops_on_served_formats() -> None:
    """On the GPU with the served cache formats (fp8 UE8M0 KV, MXFP4 indexer keys): every op
    on its Triton kernel (bf16 tensor-core dots, autotuned) against every op on its torch
    reference, the same tokens fed to both, several requests and chunked prefill."""
    cfg = tiny_config().with_overrides(num_nextn_predict_layers=0)
    model = random_model(cfg, seed=5, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(2)
    cores = []
    for backend in ("ref", "triton"):
        core = make_core(model, kv="fp8", index="mxfp4", budget=160, paged=PAGED,
                         kernels=KernelBackendConfig(default=backend), max_num_seqs=4)  # fmt: skip
        cores.append(core)
    for n in (1, 130, 300):
        prompt = torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist()
        for core in cores:
            core.add_request(greedy_request(f"r{n}", prompt, 6))
    steps = [s for s in _lockstep_logits(*cores) if s[0].numel()]
    assert len(steps) >= 6
    # NOTE: measured on the H200: each kernel alone is within 0.5% of its reference, but bf16
    # tensor-core rounding flips discontinuous choices (expert routing, C4 top-k, fp8 scales)
    # of this random model, so later steps drift (up to 37% max-relative after 6 steps with
    # every op swapped). The first steps pin the wiring; the interpreter test (fp32 dots) holds
    # every step to 6%.
    for ref, tri in steps[:2]:
        assert (ref - tri).abs().max() < 0.06 * ref.abs().max()
    for core in cores:
        assert_no_leaks(core)


def test_shared_expert_lives_in_the_routed_storage(tiny) -> None:
    """The tiny model's shared expert has a routed expert's shape and clamp: it is slot E of
    the stacked storage (what `fuse_shared_expert` runs), and its module reads that slot."""
    from dsv4.runner.paged.weights import stack_experts

    moe = tiny.layers[0].ffn
    stacked = stack_experts(moe)
    e = len(moe.experts)
    assert stacked.w13_all is not None and stacked.w13_all.shape[0] == e + 1
    inter = stacked.w13.shape[1] // 2
    assert torch.equal(stacked.w13_all[e, :inter], moe.shared_experts.w1.weight)
    assert stacked.w13_all[e].data_ptr() == moe.shared_experts.w1.weight.data_ptr()
