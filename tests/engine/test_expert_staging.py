"""Prefill steps with offloaded experts through the pool's shared staging buffer
(dsv4/runner/paged/expert_staging.py): the all-resident output bit for bit, the slot table
untouched, the traffic counted, and the paged forward's logits equal to all-resident."""

from __future__ import annotations

import copy

import pytest
import torch

from dsv4.config.model import tiny_config
from dsv4.model.tiny import random_model
from dsv4.ops.expert_slots import COUNTER_NAMES
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
    layer 0's 3 resident experts in place and its 5 misses in groups of 2, 2, 1 through the
    halves (the third group refills half 0); having missed every cold expert, it copies layer
    1's first 4 cold experts into halves 1 and 0, so layer 1 copies only its fifth. Outputs of
    both layers equal the all-resident pool's bit for bit (with MXFP4 the interpreted Triton
    kernels, the bf16-scratch path at this size)."""
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
        first, second = pool.layers[:2]
        tables = [first.table.clone(), second.table.clone()]
        outs.append([first.experts(u, ids, w, cfg.swiglu_limit)])
        if cold:
            assert pool.staging is not None and pool.staging.half == 2
            assert pool.staging.ahead is not None and pool.staging.ahead.pool is second
            assert [g.half for g in pool.staging.ahead.groups] == [1, 0]
        outs[-1].append(second.experts(u, ids, w, cfg.swiglu_limit))
        pool.mirror()
        rows = pool.host_counters.tolist()
        layer0, layer1 = (dict(zip(COUNTER_NAMES, rows[i], strict=False)) for i in (0, 1))
        stats = pool.stats()
        if cold:
            assert all(torch.equal(p.table, t) for p, t in zip((first, second), tables))
            assert layer0["fetches"] == 5 and layer0["resident_hits"] == 3
            assert layer0["cache_hits"] == 0 and layer0["prefetches"] == 0
            # layer 1: 4 copied ahead (prefetched, then cache hits), its fifth fetched
            assert layer1["prefetches"] == 4 and layer1["cache_hits"] == 4
            assert layer1["fetches"] == 1 and layer1["resident_hits"] == 3
            # layer 1 missed every cold expert too: it copied 4 of layer 2's ahead
            assert stats.prefetches == 8 and stats.copy_wait_ns > 0
            assert stats.bytes_fetched == (5 + 4 + 1 + 4) * first.row_bytes
            # layer 1's groups: halves 1, 0 (ahead), then its fifth expert in half 1
            assert pool.staging.next_half == 0 and pool.staging.ahead.pool is pool.layers[2]
        else:
            assert pool.staging is None
        assert_no_leaks(pool)
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1], strict=True))


def _pooled(model, cold: int, staging: int):
    """A copy of `model` with `cold` of 8 experts a layer offloaded, 2 slots, `staging` rows."""
    options = PoolOptions((cold,), cache_slots=2, max_decode_tokens=1, staging_experts=staging)
    return pool_experts(copy.deepcopy(model), options, "cpu", KernelBackendConfig())


@pytest.mark.parametrize("num_tokens", [4, 11])
def test_a_small_staged_step_reads_its_routing_and_copies_only_its_misses(num_tokens) -> None:
    """Under 3 pairs an expert (8 experts, top-2: up to 11 tokens) a step reads its routing on
    the host and copies only its misses (the routed way), layer after layer: outputs equal the
    all-resident pool's, each layer counts the experts it used, and the bytes are the copies'."""
    from dsv4.runner.paged.expert_staging_steps import streams

    assert not streams(num_tokens * 2, 8)
    model = random_model(CFG, seed=7, dtype=torch.bfloat16)
    u, ids, w = _step(num_tokens, seed=num_tokens)
    outs = []
    for cold, staging in ((0, 0), (5, 4)):
        pool = _pooled(model, cold, staging)
        outs.append([layer.experts(u, ids, w, CFG.swiglu_limit) for layer in pool.layers[:3]])
        pool.mirror()
        if cold:
            rows = [dict(zip(COUNTER_NAMES, r, strict=False)) for r in pool.host_counters.tolist()]
            for layer in rows[:3]:
                uses = layer["resident_hits"] + layer["cache_hits"] + layer["fetches"]
                assert uses == len(ids.unique())
            copies = sum(r["fetches"] + r["prefetches"] for r in rows)
            assert pool.stats().bytes_fetched == copies * pool.layers[0].row_bytes
        assert_no_leaks(pool)
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1], strict=True))


def test_copies_ahead_are_dropped_when_another_layer_stages_first() -> None:
    """Layer 0's step copies layer 1's experts ahead; a step that stages layer 2 next (layer
    1 skipped) neither uses nor trusts them, and layer 1's later step copies its own: every
    output equals the all-resident pool's."""
    model = random_model(CFG, seed=5, dtype=torch.bfloat16)
    u, ids, w = _step(120, seed=8)
    outs = []
    for cold, staging in ((0, 0), (5, 4)):
        pool = _pooled(model, cold, staging)
        layers = pool.layers
        outs.append([layers[i].experts(u, ids, w, CFG.swiglu_limit) for i in (0, 2, 1)])
        if cold:
            pool.mirror()
            fetches = pool.host_counters[:3, COUNTER_NAMES.index("fetches")].tolist()
            assert fetches == [5, 5, 5]  # layers 2 and 1 found nothing of theirs ahead
        assert_no_leaks(pool)
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1], strict=True))


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


def test_staging_copies_runs_of_rows_and_strided_host_rows() -> None:
    """The copies into a half: runs of consecutive host rows from contiguous host parts, and
    row by row from strided ones (rows adopted from an offload store's blobs) -> the same
    bytes as the rows they name."""
    from dsv4.model.moe import ExpertWeights
    from dsv4.runner.paged.expert_pool import LayerPool
    from dsv4.runner.paged.expert_staging import Group, Staging

    gen = torch.Generator().manual_seed(4)
    blobs = torch.randint(0, 255, (6, 40), generator=gen, dtype=torch.uint8)
    strided = (blobs[:, :24].view(6, 4, 6), blobs[:, 24:].view(6, 16))  # rows at stride 40
    contiguous = tuple(t.contiguous() for t in strided)

    def rows(n: int) -> ExpertWeights:
        return ExpertWeights(torch.zeros(n, 4, 6, dtype=torch.uint8),
                             torch.zeros(n, 16, dtype=torch.uint8), format="bf16")  # fmt: skip

    staging = Staging(rows(4), None)
    for host in (contiguous, strided):
        # 8 experts: 0 and 1 resident (rows 0, 1), 2..7 cold in host rows 0..5, 1 slot
        pool = LayerPool(rows(3), host, [0, 1], 8, torch.zeros(10, dtype=torch.int64),
                         KernelBackendConfig())  # fmt: skip
        staging.fill(pool, Group(1, (5, 6)))  # one run: host rows 3, 4 -> staging rows 2, 3
        staging.fill(pool, Group(0, (7, 3)))  # two runs: 5 -> row 0, 1 -> row 1
        for part, src in zip(staging.parts, host, strict=True):
            assert torch.equal(part, src[[5, 1, 3, 4]])
        for part in staging.parts:
            part.zero_()
