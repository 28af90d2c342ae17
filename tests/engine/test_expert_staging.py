"""Prefill steps with offloaded experts through the pool's shared staging buffer
(dsv4/runner/paged/expert_staging.py): the all-resident output bit for bit, the slot table
untouched, the traffic counted, and the paged forward's logits equal to all-resident."""

from __future__ import annotations

import copy

import pytest
import torch

from dsv4.config.model import tiny_config
from dsv4.model.tiny import random_model
from dsv4.runner.paged import PoolOptions, pool_experts
from kernels.backend import KernelBackendConfig
from tests.engine.test_expert_pool import _lockstep
from tests.leak import assert_no_leaks

CFG = tiny_config().with_overrides(num_nextn_predict_layers=0)
FP4 = CFG.with_overrides(expert_dtype="fp4")


def _step(num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(num_tokens, CFG.hidden_size, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(num_tokens)]).int()
    return u, ids, torch.rand(num_tokens, 2, generator=gen)


@pytest.mark.parametrize(("fmt", "backend"), [("bf16", "auto"), ("mxfp4", "triton")])
def test_a_staged_prefill_equals_all_resident_and_leaves_the_slots_alone(fmt, backend) -> None:
    """5 of 8 experts cold, 4 slots, 4 staging rows (halves of 2): a 200-token step computes
    the 3 resident experts in place and the 5 misses in groups of 2, 2, 1 through the halves
    (the third group refills half 0); outputs equal the all-resident pool's bit for bit (with
    MXFP4 the interpreted Triton kernels, the bf16-scratch path at this size)."""
    cfg, weights = (CFG, "bf16") if fmt == "bf16" else (FP4, "checkpoint")
    model = random_model(cfg, seed=19, dtype=torch.bfloat16, expert_weights=weights)
    kernels = KernelBackendConfig(default=backend)
    u, ids, w = _step(200, seed=3)
    outs = []
    for cold, staging in ((0, 0), (5, 4)):
        pooled = copy.deepcopy(model)
        options = PoolOptions((cold,), cache_slots=4, max_decode_tokens=1,
                              staging_experts=staging)  # fmt: skip
        pool = pool_experts(pooled, options, "cpu", kernels)
        layer = pool.layers[0]
        table = layer.table.clone()
        outs.append(layer.experts(u, ids, w, cfg.swiglu_limit))
        pool.mirror()
        stats = pool.stats()
        if cold:
            assert pool.staging is not None and pool.staging.half == 2
            assert torch.equal(layer.table, table)  # no slot was filled or evicted
            assert stats.fetches == 5 and stats.resident_hits == 3 and stats.cache_hits == 0
            assert stats.bytes_fetched == 5 * layer.row_bytes and stats.copy_wait_ns > 0
            assert pool.staging.next_half == 1  # 3 groups: halves 0, 1, 0; the next is 1
        else:
            assert pool.staging is None
        assert_no_leaks(pool)
    assert torch.equal(outs[0], outs[1])


def test_the_paged_forward_with_staging_gives_all_resident_logits() -> None:
    """Prompts of 90 and 23 tokens, then decode steps: prefills through the staging buffer,
    decodes through the slots; every step's logits equal the all-resident model's."""
    resident = random_model(CFG, seed=23)
    pooled = copy.deepcopy(resident)
    options = PoolOptions((5,), cache_slots=1, max_decode_tokens=2, staging_experts=2)
    pool = pool_experts(pooled, options, "cpu", KernelBackendConfig())
    steps, _ = _lockstep(resident, pooled)
    assert len(steps) >= 6 and all(torch.equal(a, b) for a, b in steps)
    pool.mirror()
    assert pool.stats().fetches > 0
    assert_no_leaks(pool)


@pytest.mark.gpu
@pytest.mark.parametrize(("fmt", "prefetch"), [("bf16", False), ("mxfp4", True)])
def test_staged_prefills_on_the_gpu_equal_resident(fmt, prefetch) -> None:
    """The Triton kernels on the GPU: cold experts in pinned host memory, prefills through a
    4-expert staging buffer on the copy stream (with `prefetch`, beside the pre-gated slot
    copies on the same stream), decodes in captured graphs through the slots: logits bit for
    bit in lockstep, then the greedy tokens of prompts of 1, 130 and 300 tokens."""
    from dsv4.runner.paged.decode_graphs import GraphOptions
    from dsv4.runner.paged.forward_state import PagedSwitches
    from tests.engine.conftest import greedy_request, make_core, run_to_completion

    cfg, weights = (CFG, "bf16") if fmt == "bf16" else (FP4, "checkpoint")
    kernels = KernelBackendConfig(default="triton")
    resident = random_model(cfg, seed=29, dtype=torch.bfloat16, device="cuda",
                            expert_weights=weights)  # fmt: skip
    pooled = copy.deepcopy(resident)
    options = PoolOptions((6,), cache_slots=1, max_decode_tokens=2, staging_experts=4)
    pool = pool_experts(pooled, options, "cuda", kernels)
    assert pool.staging is not None and pool.layers[0].num_slots == 4
    steps, _ = _lockstep(resident, pooled, kernels=kernels, kv="fp8", index="mxfp4")
    assert all(torch.equal(a, b) for a, b in steps)
    gen = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist() for n in (1, 130, 300)
    ]
    outs, paged = [], {"switches": PagedSwitches(expert_prefetch=prefetch)}
    for model in (resident, pooled):
        core = make_core(model, kv="fp8", index="mxfp4", budget=512, paged=paged, kernels=kernels,
                         graphs=GraphOptions(max_batch=2, max_model_len=1024), max_num_seqs=2)  # fmt: skip
        for i, p in enumerate(prompts):
            core.add_request(greedy_request(f"r{i}", p, 8))
        outs.append(run_to_completion(core))
        assert_no_leaks(core)
    assert outs[0] == outs[1]
    pool.mirror()
    assert pool.stats().fetches > 0 and pool.stats().copy_wait_ns > 0
    assert_no_leaks(pool)
