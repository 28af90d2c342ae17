"""The paged forward with offloaded experts in an expert pool (dsv4/runner/paged/expert_pool.py)
gives the all-resident paged forward's logits bit for bit: decode steps in one round, prefill
steps in rounds, bf16 experts pooled from the stacked storage and MXFP4 experts pooled from the
load-time offload split; the slot table stays consistent and the stats count the traffic."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from dsv4.config.model import tiny_config
from dsv4.errors import ConfigError, ExpertPoolError, StepFailed
from dsv4.model.offload_load import ExpertOffload
from dsv4.model.tiny import random_model
from dsv4.ops.expert_slots import COUNTER_NAMES, ERR_STALE, ERRORS
from dsv4.runner.paged import PoolOptions, pool_experts
from dsv4.runner.paged.decode_graphs import GraphOptions
from dsv4.runner.paged.expert_rounds import round_groups
from dsv4.runner.paged.forward_state import PagedSwitches
from kernels.backend import KernelBackendConfig
from tests.engine.conftest import greedy_request, make_core, run_to_completion
from tests.engine.test_paged_forward import _lockstep_logits
from tests.leak import assert_no_leaks

CFG = tiny_config().with_overrides(num_nextn_predict_layers=0)
FP4 = CFG.with_overrides(expert_dtype="fp4")
# 5 of 8 experts cold; max_decode_tokens 2 -> 4 slots (2 tokens x top-2): one-round decodes
OPTIONS = PoolOptions(num_offloaded=(5,), cache_slots=1, max_decode_tokens=2)


def _prompts(vocab: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(11)
    return {"a": torch.randint(2, vocab, (90,), generator=gen).tolist(),
            "b": torch.randint(2, vocab, (23,), generator=gen).tolist()}  # fmt: skip


def _lockstep(resident, pooled, paged=None, **core) -> tuple[list, list]:
    cores = [make_core(m, budget=64, paged=paged or {}, max_num_seqs=2, **core)
             for m in (resident, pooled)]  # fmt: skip

    for core_ in cores:
        for rid, prompt in _prompts(resident.cfg.vocab_size).items():
            core_.add_request(greedy_request(rid, prompt, 6))
    steps = _lockstep_logits(*cores)
    for core_ in cores:
        assert_no_leaks(core_)
    return steps, cores


def _pooled(model, options=OPTIONS):
    pooled = copy.deepcopy(model)
    return pooled, pool_experts(pooled, options, "cpu", KernelBackendConfig())


def test_pooled_bf16_experts_equal_all_resident_bit_for_bit() -> None:
    resident = random_model(CFG, seed=3)
    pooled, pool = _pooled(resident)
    assert [p.num_slots for p in pool.layers] == [4] * CFG.num_hidden_layers
    steps, _ = _lockstep(resident, pooled)
    assert len(steps) >= 6 and all(torch.equal(a, b) for a, b in steps)
    pool.mirror()  # the lockstep drives the forwards, not the step forward that mirrors
    stats = pool.stats()
    e, r = CFG.n_routed_experts, CFG.n_routed_experts - 5
    row = pool.layers[0].row_bytes
    assert stats.fetches > 0 and stats.bytes_fetched == stats.fetches * row
    assert stats.resident_hits > 0 and 0 < stats.hit_rate < 1 and stats.copy_wait_ns > 0
    assert pool.layers[0].weights.w13.shape[0] == r + 4 and pool.layers[0].host[0].shape[0] == e - r
    assert_no_leaks(pool)
    pool.reset_stats()
    assert pool.stats().uses == 0 and pool.stats().copy_wait_ns == 0


def test_pooled_mxfp4_experts_from_the_offload_split_equal_all_resident() -> None:
    """The load-time split (resident blobs on the device, cold blobs in host memory) becomes the
    pool; a residency order picks which experts stay."""
    resident = random_model(FP4, seed=4, expert_weights="checkpoint")
    order = tuple((7, 2, 5, 0, 1, 3, 4, 6) for _ in range(CFG.num_hidden_layers))
    split = random_model(FP4, seed=4, expert_weights="checkpoint",
                         offload=ExpertOffload(5, 2, order))  # fmt: skip
    store = split.layers[0].ffn.expert_store
    blob = store.host[min(store.host)]
    pool = pool_experts(split, PoolOptions((5,), order, 1, 2), "cpu", KernelBackendConfig())
    assert pool.layers[0].weights.format == "mxfp4"
    # the store's cold blobs are the pool's host rows (views, no host-to-host copy)
    host = pool.layers[0].host
    assert len(host) == 4 and host[0].data_ptr() == blob.data_ptr()
    assert host[0].stride(0) * host[0].element_size() == store.fmt.nbytes
    assert sorted(e for e, r in enumerate(pool.layers[0].table.tolist()) if r >= 0) == [2, 5, 7]
    steps, _ = _lockstep(resident, split)
    assert all(torch.equal(a, b) for a, b in steps)
    pool.mirror()
    assert pool.stats().fetches > 0
    assert_no_leaks(pool)


def test_one_slot_runs_every_step_in_rounds() -> None:
    """S = 1: every step with two or more misses runs in rounds (decode steps too, eagerly)."""
    resident = random_model(CFG, seed=5)
    pooled, pool = _pooled(resident, PoolOptions((6,), cache_slots=1, max_decode_tokens=0))
    assert {p.num_slots for p in pool.layers} == {1}
    steps, _ = _lockstep(resident, pooled)
    assert all(torch.equal(a, b) for a, b in steps)
    assert_no_leaks(pool)


def test_static_decode_steps_equal_all_resident() -> None:
    """Decode steps as the graphs run them (static buffers, padded batch buckets; eager on the
    CPU) resolve their experts on the device only."""
    resident = random_model(CFG, seed=6)
    pooled, pool = _pooled(resident)
    graphs = GraphOptions(max_batch=2, max_model_len=2048, capture=False)
    tokens = []
    for model in (resident, pooled):
        core = make_core(model, budget=64, paged={}, max_num_seqs=2, graphs=graphs)
        for rid, prompt in _prompts(CFG.vocab_size).items():
            core.add_request(greedy_request(rid, prompt, 6))
        tokens.append(run_to_completion(core))
        assert core.runner.num_graph_replays > 0
        assert_no_leaks(core)
    assert tokens[0] == tokens[1]
    stats = pool.stats()  # mirrored by the step forward after every step
    assert stats.fetches > 0 and stats.uses == stats.hits + stats.fetches
    assert_no_leaks(pool)


def test_prefetched_experts_equal_all_resident_and_spare_the_hash_layers_their_fetches() -> None:
    """`expert_prefetch`: each layer predicts the next one's experts and its pool copies them
    in ahead. The logits stay the all-resident ones bit for bit; layers 0-2 (hash layers,
    predicted exactly from the token ids) fetch fewer experts on the critical path than
    without prefetching (10, 10, 8 -> 2, 2, 2), and the pool counts the prefetches."""
    cfg = CFG.with_overrides(num_hash_layers=3)  # layers 0-2 route by token id
    resident = random_model(cfg, seed=3)
    pools, models = [], []
    for _ in range(2):
        model, pool = _pooled(resident)
        models.append(model)
        pools.append(pool)
    cores = [make_core(m, budget=64, paged=p, max_num_seqs=2) for m, p in (
        (resident, {}), (models[0], {}),
        (models[1], {"switches": PagedSwitches(expert_prefetch=True)}))]  # fmt: skip
    for core in cores:
        for rid, prompt in _prompts(CFG.vocab_size).items():
            core.add_request(greedy_request(rid, prompt, 6))
    steps = _lockstep_logits(*cores)
    assert len(steps) >= 6 and all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in steps)
    for pool in pools:
        pool.mirror()
    fetches = [pool.host_counters[:, COUNTER_NAMES.index("fetches")].tolist() for pool in pools]
    hashed = (0, 1, 2)  # layer 0 from the step's token ids, 1 and 2 from the layer before
    assert all(fetches[1][i] <= fetches[0][i] for i in hashed), fetches
    assert sum(fetches[1][i] for i in hashed) < sum(fetches[0][i] for i in hashed), fetches
    stats = pools[1].stats()
    assert stats.prefetches > 0 and pools[0].stats().prefetches == 0
    assert stats.bytes_fetched == (stats.fetches + stats.prefetches) * pools[1].layers[0].row_bytes
    for core in cores:
        assert_no_leaks(core)
    for pool in pools:
        assert_no_leaks(pool)


def test_double_buffered_rounds_prefetch_each_next_round_and_change_no_bit() -> None:
    """A prefill-sized step on one layer's pool (all 8 experts used, 5 cold, 4 slots): with
    `lookahead` the rounds take 2 misses each and each next round's misses are prefetched
    beside the current round, so only round 0's misses are fetched on the critical path."""
    resident = random_model(CFG, seed=13)
    gen = torch.Generator().manual_seed(4)
    u = torch.randn(40, CFG.hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(40)])
    w = torch.rand(40, 2, generator=gen)
    outs, stats = [], []
    for lookahead in (False, True):
        _, pool = _pooled(resident)
        layer = pool.layers[0]
        outs.append(layer.experts(u, ids, w, CFG.swiglu_limit, lookahead=lookahead))
        pool.mirror()
        stats.append(pool.stats())
        assert_no_leaks(pool)
    assert torch.equal(outs[0], outs[1])
    assert stats[0].prefetches == 0 and stats[0].fetches == 5
    assert stats[1].fetches == 2 and stats[1].prefetches == 3  # rounds of 2, 2, 1 misses


def test_rounds_on_the_scratch_path_dequantise_only_their_rows(monkeypatch) -> None:
    """The Triton kernels (interpreted on CPU): a prefill-sized MXFP4 step (200 tokens x top-2
    over 8 experts: the bf16-scratch path) in rounds, with and without lookahead, equals the
    all-resident pool's one call bit for bit, and each round dequantises only the storage rows
    it names (3 resident + 4 slots here: round 0 its on-device experts and misses, a later
    round only its misses, where it used to dequantise all 7 rows every round)."""
    import kernels.moe_dequant as moe_dequant

    kernels = KernelBackendConfig(default="triton")
    model = random_model(FP4, seed=17, dtype=torch.bfloat16, expert_weights="checkpoint")
    gen = torch.Generator().manual_seed(6)
    u = torch.randn(200, FP4.hidden_size, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(200)]).int()
    w = torch.rand(200, 2, generator=gen)
    seen: list[int] = []
    real = moe_dequant.dequantize_experts

    def counting(w_, scale, format, e0=0, e1=None, out=None, ids=None):
        seen.append(e1 - e0)
        return real(w_, scale, format, e0, e1, out, ids)

    monkeypatch.setattr(moe_dequant, "dequantize_experts", counting)
    outs = []
    for cold, lookahead in ((0, False), (5, False), (5, True)):
        pooled = copy.deepcopy(model)
        pool = pool_experts(pooled, PoolOptions((cold,), cache_slots=4, max_decode_tokens=1),
                            "cpu", kernels)  # fmt: skip
        layer = pool.layers[0]
        seen.clear()
        outs.append(layer.experts(u, ids, w, FP4.swiglu_limit, lookahead=lookahead))
        if cold:  # w13 and w2 each: rounds [3 resident + 4 misses, 1] or [3 + 2, 2, 1]
            assert sorted(seen[::2]) == ([1, 7] if not lookahead else [1, 2, 5]), seen
        else:
            assert seen[::2] == [8], seen
        pool.mirror()
        assert_no_leaks(pool)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_round_groups() -> None:
    table = [0, -1, 3, -1, -1, 1, -1, -1]  # R = 2: experts 0, 5 resident; 2 cached (row 3)
    assert round_groups([0, 1, 2, 3, 4, 6], table, 2, 2) == [[0, 2, 1], [3, 4], [6]]
    assert round_groups([0, 5], table, 2, 0) == [[0, 5]]
    # double-buffered: 4 slots, rounds of 2 misses (round 0: one, beside the cached expert 2)
    assert round_groups([0, 1, 2, 3, 4, 6], table, 2, 4, halves=True) == [[0, 2, 1], [3, 4], [6]]
    assert round_groups([0, 1, 3], table, 2, 1, halves=True) == [[0, 1], [3]]  # no half of 1
    with pytest.raises(ExpertPoolError):
        round_groups([1], table, 2, 0)


def test_a_stale_table_fails_the_step_and_the_pool_serves_again() -> None:
    """A corrupt table fails its step's request instead of serving tokens; the pool then
    drops its cached experts and later requests get the resident model's tokens."""
    resident = random_model(CFG, seed=7)
    pooled, pool = _pooled(resident)
    core = make_core(pooled, budget=64, paged={})
    core.add_request(greedy_request("a", [5, 6, 7, 8], 3))
    core.step()
    layer = pool.layers[1]
    on_device = [e for e, r in enumerate(layer.table.tolist()) if r >= 0]
    layer.table[on_device[0]] = layer.table[on_device[1]]  # two experts claim one row
    with pytest.raises(StepFailed, match="stale slot table"):
        run_to_completion(core)
    assert (
        not pool.counters[:, ERRORS].any() and not (pool.host_counters[:, ERRORS] & ERR_STALE).any()
    )
    assert_no_leaks(pool)
    tokens = []
    for engine in (core, make_core(resident, budget=64, paged={})):
        engine.add_request(greedy_request("b", [9, 10, 11, 12, 13], 4))
        tokens.append(run_to_completion(engine))
        assert_no_leaks(engine)
    assert tokens[0] == tokens[1]
    assert_no_leaks(pool)


def test_the_reference_forward_refuses_pooled_experts() -> None:
    pooled, _ = _pooled(random_model(CFG, seed=8))
    with pytest.raises(ConfigError, match="expert pool"):
        pooled(torch.tensor([[3, 4, 5]]))


@pytest.mark.gpu
@pytest.mark.parametrize(("fmt", "prefetch"), [("bf16", False), ("mxfp4", False), ("bf16", True),
                                               ("mxfp4_halves128", False)])  # fmt: skip
def test_pooled_experts_on_the_gpu_equal_resident_with_graphs(fmt, prefetch) -> None:
    """The Triton kernels on the GPU: cold experts in pinned host memory, fetched by the copy
    kernel inside captured decode graphs (6 of 8 cold, 4 slots, batches of 2) and in rounds for
    prefills; eager logits bit for bit, and the greedy tokens with and without graphs. With
    `prefetch`, the graphs also hold the copy stream's fork and join. MXFP4 with I 64 is served
    as stored; with I 128 re-packed (features.mxfp4_layout halves128), resident and pooled."""
    cfg, weights = (CFG, "bf16") if fmt == "bf16" else (FP4, "checkpoint")
    if fmt == "mxfp4_halves128":
        cfg = FP4.with_overrides(moe_intermediate_size=128)
    kernels = KernelBackendConfig(default="triton")
    resident = random_model(cfg, seed=5, dtype=torch.bfloat16, device="cuda",
                            expert_weights=weights)  # fmt: skip
    pooled = copy.deepcopy(resident)
    layout = "halves128" if fmt == "mxfp4_halves128" else "stored"
    options = PoolOptions((6,), cache_slots=1, max_decode_tokens=2, mxfp4_layout=layout)
    pool = pool_experts(pooled, options, "cuda", kernels)
    assert pool.layers[0].num_slots == 4, pool.layers[0].num_slots
    assert pool.layers[0].weights.format == fmt
    # cold rows stay in host memory (registered with cudaHostRegister, which torch's
    # is_pinned() does not report): the copy kernel reads them through their device address
    assert pool.layers[0].host[0].device.type == "cpu"
    switches = {"switches": PagedSwitches(mxfp4_layout=layout)}
    steps, _ = _lockstep(resident, pooled, switches, kernels=kernels, kv="fp8", index="mxfp4")
    assert all(torch.equal(a, b) for a, b in steps)
    gen = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist() for n in (1, 130, 300)
    ]
    outs, paged = [], {"switches": PagedSwitches(expert_prefetch=prefetch, mxfp4_layout=layout)}
    for model in (resident, pooled):
        for graphs in (None, GraphOptions(max_batch=2, max_model_len=1024)):
            core = make_core(model, kv="fp8", index="mxfp4", budget=512, paged=paged,
                             kernels=kernels, graphs=graphs, max_num_seqs=2)  # fmt: skip
            for i, p in enumerate(prompts):
                core.add_request(greedy_request(f"r{i}", p, 8))
            outs.append(run_to_completion(core))
            if graphs is not None:
                assert core.runner.forward.graphs.passes["target"].num_runs >= 6
            assert_no_leaks(core)
    assert outs[0] == outs[1] == outs[2] == outs[3]
    assert pool.stats().fetches > 0 and (pool.stats().prefetches > 0) == prefetch
    assert pool.stats().copy_wait_ns > 0
    assert_no_leaks(pool)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["stored", "halves128"])
def test_the_gpu_pool_serves_the_adopted_pinned_store_rows(layout) -> None:
    """The load-time split on the GPU (cold blobs in registered host memory) becomes the pool
    without a copy (halves128: re-packed in place on the card): the copy kernel reads the
    store's blobs at their row stride; logits equal all-resident bit for bit."""
    kernels = KernelBackendConfig(default="triton")
    model = dict(seed=9, dtype=torch.bfloat16, device="cuda", expert_weights="checkpoint")
    cfg = FP4.with_overrides(moe_intermediate_size=128) if layout == "halves128" else FP4
    resident = random_model(cfg, **model)
    split = random_model(cfg, **model, offload=ExpertOffload(6, 1))
    store = split.layers[0].ffn.expert_store
    blob = store.host[min(store.host)]
    options = PoolOptions((6,), cache_slots=1, max_decode_tokens=2, mxfp4_layout=layout)
    pool = pool_experts(split, options, "cuda", kernels)
    assert pool.layers[0].host[0].data_ptr() == blob.data_ptr()
    switches = {"switches": PagedSwitches(mxfp4_layout=layout)}
    steps, _ = _lockstep(resident, split, switches, kernels=kernels, kv="fp8", index="mxfp4")
    assert all(torch.equal(a, b) for a, b in steps)
    pool.mirror()
    assert pool.stats().fetches > 0
    assert_no_leaks(pool)


def test_copy_wait_counts_the_steps_that_copy_and_not_the_hits() -> None:
    """On CPU the stamps (the host clock) time a step's copy of its misses into `copy_wait_ns`;
    a step whose experts are all on the device adds nothing, nor does a predicted routing
    prefetched ahead (on CPU it runs in order: no stream to join, no wait)."""
    _, pool = _pooled(random_model(CFG, seed=14))
    layer = pool.layers[0]
    cold = [e for e, row in enumerate(layer.table.tolist()) if row < 0]
    ids = torch.tensor([cold[:2]])
    layer.resolve(ids)
    pool.mirror()
    fetched = pool.stats()
    assert fetched.fetches == 2 and fetched.copy_wait_ns > 0
    layer.resolve(ids)  # both in their slots now
    layer.prefetch(torch.tensor([cold[2:4]]))
    layer.resolve(torch.tensor([cold[2:4]]))  # prefetched: cache hits
    pool.mirror()
    hits = pool.stats()
    assert (hits.cache_hits, hits.fetches, hits.prefetches) == (4, 2, 2)
    assert hits.copy_wait_ns == fetched.copy_wait_ns
    pool.reset_stats()
    assert pool.stats().copy_wait_ns == 0
    assert_no_leaks(pool)


@pytest.mark.gpu
def test_copy_wait_is_stamped_inside_a_captured_graph() -> None:
    """One layer's pool on the GPU, in a captured graph: a prefetch on the copy stream joined
    by the layer, then its own misses copied. Cycling three pairs of cold experts through its
    four slots makes every replay miss, so each replay waits for copies: `copy_wait_ns` grows,
    and by less than the replays' wall time."""
    kernels = KernelBackendConfig(default="triton")
    model = random_model(CFG, seed=15, dtype=torch.bfloat16, device="cuda")
    pool = pool_experts(model, PoolOptions((6,), cache_slots=1, max_decode_tokens=2), "cuda",
                        kernels)  # fmt: skip
    layer = pool.layers[0]
    cold = [e for e, row in enumerate(layer.table.tolist()) if row < 0]
    pairs = [cold[0:2], cold[2:4], cold[4:6]]
    ids = torch.tensor([pairs[0]], device="cuda")
    predicted = ids[:, :1].clone()  # the first of each pair comes by prefetch

    def step() -> None:
        layer.prefetch(predicted)
        layer.resolve(ids)

    step()  # compile every kernel before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    pool.reset_stats()
    torch.cuda.synchronize()
    start = time.perf_counter_ns()
    for i in range(1, 13):
        ids.copy_(torch.tensor([pairs[i % 3]]))
        predicted.copy_(ids[:, :1])
        graph.replay()
    torch.cuda.synchronize()
    wall_ns = time.perf_counter_ns() - start
    pool.mirror()
    torch.cuda.synchronize()
    stats = pool.stats()
    assert stats.fetches == 12 and stats.prefetches == 12, stats
    assert 0 < stats.copy_wait_ns < wall_ns, (stats.copy_wait_ns, wall_ns)
    assert_no_leaks(pool)


def test_mtp_speculation_with_pooled_experts_gives_the_resident_tokens() -> None:
    """The MTP layer's experts pooled too; verify, accept and propose read the pool, and each
    step's check waits for its counters (the speculative half reads tokens before mirroring)."""
    cfg = tiny_config()  # with its MTP layer
    resident = random_model(cfg, seed=12)
    pooled, pool = _pooled(resident, PoolOptions((5,), max_decode_tokens=4))
    assert len(pool.layers) == cfg.num_hidden_layers + 1
    tokens = []
    for model in (resident, pooled):
        core = make_core(model, budget=64, paged={}, max_num_seqs=2, spec_tokens=1)
        for rid, prompt in _prompts(cfg.vocab_size).items():
            core.add_request(greedy_request(rid, prompt, 6))
        tokens.append(run_to_completion(core))
        assert_no_leaks(core)
    assert tokens[0] == tokens[1]
    assert pool.stats().fetches > 0 and pool.layers[-1].counters[0:3].sum() > 0
    assert_no_leaks(pool)
