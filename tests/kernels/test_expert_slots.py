"""The expert pool's slot kernels (`resolve_slots`, `prefetch_slots`, `copy_fetched`) against
their references (dsv4/ops/expert_slots.py), exactly: every output and every piece of updated
state, step after step, with repeated ids, skipped pairs, more misses than slots, a corrupted
table and predicted routings placed ahead of their step. The clock stamps (`copy_wait_start`,
`copy_wait_end`) time real waits: the references on the host clock here, the kernels on the
GPU's timer (a GPU test; their sm_90 compile is checked in test_sm90_compile.py)."""

from __future__ import annotations

import time

import pytest
import torch

from dsv4.ops.expert_slots import (
    COPY_WAIT_MARK,
    COPY_WAIT_NS,
    COUNTERS,
    ERR_OVERFLOW,
    ERR_STALE,
    ERRORS,
    PREFETCHES,
    STEP,
    SlotTable,
    copy_fetched_ref,
    copy_wait_end_ref,
    copy_wait_start_ref,
    prefetch_slots_ref,
    resolve_slots_ref,
)
from kernels.expert_slots import (
    copy_fetched,
    copy_wait_end,
    copy_wait_start,
    prefetch_slots,
    resolve_slots,
)
from tests.kernels.conftest import DEVICE

E, R, S, ROW_BYTES = 12, 4, 3, 96


def fresh_state(num_experts=E, resident=(1, 4, 6, 9), slots=S, device=DEVICE):
    """(table, owner, last_used, cold_row, counters, fetch) of a pool with `resident` on the
    device (rows 0..R-1) and every other expert in host row order."""
    r = len(resident)
    table = torch.full((num_experts,), -1, dtype=torch.int32)
    owner = torch.full((r + slots,), -1, dtype=torch.int32)
    for i, e in enumerate(resident):
        table[e], owner[i] = i, e
    cold = [e for e in range(num_experts) if e not in resident]
    cold_row = torch.full((num_experts,), -1, dtype=torch.int32)
    cold_row[cold] = torch.arange(len(cold), dtype=torch.int32)
    state = (table, owner, torch.zeros(slots, dtype=torch.int64), cold_row,
             torch.zeros(COUNTERS, dtype=torch.int64), torch.zeros(slots, dtype=torch.int32))  # fmt: skip
    return tuple(t.to(device) for t in state)


def both(ids, state, num_resident=R):
    """(rows, state) of the reference and of the kernel on copies of `state`."""
    out = []
    for fn in (resolve_slots_ref, resolve_slots):
        s = tuple(t.clone() for t in state)
        rows = fn(ids, SlotTable(*s, num_resident, ROW_BYTES))
        out.append((rows, s))
    return out


def assert_same(a, b) -> None:
    (rows_a, state_a), (rows_b, state_b) = a, b
    assert torch.equal(rows_a.cpu(), rows_b.cpu())
    for x, y in zip(state_a, state_b):
        assert torch.equal(x.cpu(), y.cpu()), (x, y)


def assert_consistent(ids, rows, state, num_resident=R) -> None:
    """The table and the owners agree, and every pair reads its expert's row."""
    table, owner, *_ = (t.cpu() for t in state)
    for e in range(table.numel()):
        if table[e] >= 0:
            assert owner[table[e]] == e
    for row, e in enumerate(owner.tolist()):
        assert e < 0 or table[e] == row
    ids, rows = ids.cpu().reshape(-1), rows.cpu().reshape(-1)
    valid = ids >= 0
    assert torch.equal(rows[valid].long(), table[ids[valid]].long())
    assert (rows[~valid] == -1).all()


def test_steps_of_random_routing_match_the_reference_and_keep_the_table_consistent() -> None:
    gen = torch.Generator().manual_seed(0)
    state = fresh_state()
    fetched = 0
    for step in range(12):
        t = int(torch.randint(1, 4, (1,), generator=gen))
        # at most S distinct cold experts: one round always fits (k = 2, t <= 3 -> <= 6 ids)
        pool = torch.tensor([1, 4, 6, 9, *torch.randperm(12, generator=gen)[:8].tolist()])
        ids = pool[torch.randint(0, pool.numel(), (t, 2), generator=gen)]
        cold = {e for e in ids.flatten().tolist() if e not in (1, 4, 6, 9)}
        if len(cold) > S:
            ids = torch.where(torch.isin(ids, torch.tensor(sorted(cold)[S:])), 4, ids)
        if step % 4 == 3:
            ids[0, 0] = -1  # a skipped pair
        ids = ids.to(DEVICE)
        ref, ker = both(ids, state)
        assert_same(ref, ker)
        rows, state = ker
        assert_consistent(ids, rows, state)
        counters = state[4].cpu()
        assert counters[ERRORS] == 0 and counters[4] == step + 1
        fetched += int((state[5] >= 0).sum())
        assert counters[2] == fetched and counters[3] == fetched * ROW_BYTES


def test_repeated_ids_fetch_once_and_hits_evict_nothing() -> None:
    state = fresh_state()
    ids = torch.tensor([[0, 2], [0, 0], [2, 1]], device=DEVICE)
    (rows, state), ker = both(ids, state)
    assert_same((rows, state), ker)
    table, _, _, _, counters, fetch = (t.cpu() for t in state)
    # misses 0 and 2 (ascending) take the empty slots 0 and 1 (rows R, R + 1); host rows 0, 1
    assert fetch.tolist() == [0, 1, -1] and table[0] == R and table[2] == R + 1
    assert counters[:4].tolist() == [1, 0, 2, 2 * ROW_BYTES]
    # next step: 0 is a cache hit, 3 and 5 are misses; slot 2 is empty, then the LRU non-used
    ids = torch.tensor([[0, 3], [5, 3]], device=DEVICE)
    (rows, state), ker = both(ids, state)
    assert_same((rows, state), ker)
    table = state[0].cpu()
    assert table[0] == R and table[2] == -1 and table[3] == R + 2 and table[5] == R + 1
    assert_consistent(ids, rows, state)


def test_more_misses_than_slots_sets_the_overflow_bit_and_reads_row_zero() -> None:
    ids = torch.tensor([[0, 2, 3, 5, 7]], device=DEVICE)
    ref, ker = both(ids, fresh_state())
    assert_same(ref, ker)
    rows, state = ker
    assert state[4].cpu()[ERRORS] & ERR_OVERFLOW
    assert rows.cpu().tolist() == [[R, R + 1, R + 2, 0, 0]]


def test_a_stale_table_is_flagged() -> None:
    state = fresh_state()
    state[0][5] = 2  # expert 5 claims row 2, which expert 6 owns
    ref, ker = both(torch.tensor([[5, 1]], device=DEVICE), state)
    assert_same(ref, ker)
    assert ker[1][4].cpu()[ERRORS] & ERR_STALE


def test_an_all_cold_layer_of_many_experts() -> None:
    """R = 0 and E = 40 (a block of 64 lanes), 70 pairs (two pair loops)."""
    state = fresh_state(40, (), 16)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        ids = torch.randint(0, 40, (35, 2), generator=gen).to(DEVICE)
        ids[ids >= 16] = ids[ids >= 16] % 4  # <= 16 distinct
        ref, ker = both(ids, state, 0)
        assert_same(ref, ker)
        rows, state = ker
        assert_consistent(ids, rows, state, 0)


def prefetch_both(ids, state, num_resident=R):
    """The states after `prefetch_slots` (reference, kernel) on copies of `state`."""
    out = []
    for fn in (prefetch_slots_ref, prefetch_slots):
        s = tuple(t.clone() for t in state)
        fn(ids, SlotTable(*s, num_resident, ROW_BYTES))
        out.append(s)
    return out


def test_a_prefetch_places_the_predicted_misses_and_the_step_then_hits_them() -> None:
    """Predicted 0, 2, 3, 5 (four misses, three slots): the first three by id take the slots,
    counted as prefetches (no overflow: a hint); the step that then routes to 0 and 3 finds
    them as cache hits and fetches nothing; a wrong guess (5) is fetched by the step."""
    predicted = torch.tensor([[0, 2], [3, 5]], device=DEVICE)
    ref, ker = prefetch_both(predicted, fresh_state())
    for a, b in zip(ref, ker):
        assert torch.equal(a.cpu(), b.cpu())
    table, owner, last_used, _, counters, fetch = (t.cpu() for t in ker)
    assert fetch.tolist() == [0, 1, 2] and owner[R:].tolist() == [0, 2, 3]
    assert table[[0, 2, 3, 5]].tolist() == [R, R + 1, R + 2, -1]
    assert counters[PREFETCHES] == 3 and counters[3] == 3 * ROW_BYTES
    assert counters[:3].tolist() == [0, 0, 0] and counters[STEP] == 0 and counters[ERRORS] == 0
    assert last_used.tolist() == [1, 1, 1]  # stamped with the coming step
    ids = torch.tensor([[0, 3], [3, 1]], device=DEVICE)
    ref, ker2 = both(ids, ker)
    assert_same(ref, ker2)
    rows, state = ker2
    assert_consistent(ids, rows, state)
    assert state[4].cpu()[:3].tolist() == [1, 2, 0]  # resident 1; cache 0 and 3; no fetch
    ids = torch.tensor([[5, 1]], device=DEVICE)  # the miss the prefetch could not place
    ref, ker3 = both(ids, state)
    assert_same(ref, ker3)
    assert ker3[1][4].cpu()[2] == 1 and ker3[1][4].cpu()[ERRORS] == 0


def test_random_prefetches_and_steps_match_the_reference() -> None:
    gen = torch.Generator().manual_seed(7)
    state = fresh_state()
    for step in range(10):
        guess = torch.randint(0, E, (2, 2), generator=gen).to(DEVICE)
        ref, ker = prefetch_both(guess, state)
        for a, b in zip(ref, ker):
            assert torch.equal(a.cpu(), b.cpu())
        ids = torch.where(torch.rand(2, 2, generator=gen) < 0.5, guess.cpu(), 4)
        cold = sorted({e for e in ids.flatten().tolist() if e not in (1, 4, 6, 9)})
        ids = torch.where(torch.isin(ids, torch.tensor(cold[S:] or [-2])), 6, ids).to(DEVICE)
        ref, ker = both(ids, ker)
        assert_same(ref, ker)
        rows, state = ker
        assert_consistent(ids, rows, state)
        assert state[4].cpu()[ERRORS] == 0 and state[4].cpu()[STEP] == step + 1


@pytest.mark.parametrize("dtypes", [(torch.bfloat16,) * 2, (torch.int8, torch.int8,
                                     torch.float8_e8m0fnu, torch.float8_e8m0fnu)])  # fmt: skip
def test_copy_fetched_matches_the_reference(dtypes) -> None:
    gen = torch.Generator().manual_seed(1)
    shapes = [(6, 5), (3, 8), (6, 1), (3, 2)][: len(dtypes)]
    src = tuple(torch.randint(0, 120, (7, *s), generator=gen).to(d) for s, d in zip(shapes, dtypes))
    dst = tuple(torch.zeros(R + S, *s, dtype=d, device=DEVICE) for s, d in zip(shapes, dtypes))
    fetch = torch.tensor([5, -1, 2], dtype=torch.int32, device=DEVICE)
    expect = tuple(d.clone() for d in dst)
    copy_fetched_ref(fetch, expect, src, R)
    copy_fetched(fetch, dst, tuple(s.to(DEVICE) for s in src), R)
    for d, x, s in zip(dst, expect, src):
        assert torch.equal(d.view(torch.uint8).cpu(), x.view(torch.uint8).cpu())
        assert torch.equal(d[R].cpu().view(torch.uint8), s[5].view(torch.uint8))
        assert (d[R + 1].cpu().view(torch.uint8) == 0).all()


def test_copy_fetched_reads_host_rows_at_a_stride() -> None:
    """Host rows that are column slices of one [rows, blob] allocation (the pool adopting an
    offload store's blobs): each part is read at the blob's row stride."""
    gen = torch.Generator().manual_seed(2)
    blobs = torch.randint(0, 255, (7, 96), generator=gen, dtype=torch.uint8).to(DEVICE)
    src = (blobs[:, 0:40].view(7, 5, 8), blobs[:, 48:72].view(torch.bfloat16).view(7, 3, 4))
    assert not src[0].is_contiguous()
    dst = tuple(torch.zeros(R + S, *s.shape[1:], dtype=s.dtype, device=DEVICE) for s in src)
    fetch = torch.tensor([-1, 6, 2], dtype=torch.int32, device=DEVICE)
    expect = tuple(d.clone() for d in dst)
    copy_fetched_ref(fetch, expect, src, R)
    copy_fetched(fetch, dst, src, R)
    for d, x, s in zip(dst, expect, src):
        assert torch.equal(d.view(torch.uint8), x.view(torch.uint8))
        assert torch.equal(d[R + 1], s[6]) and torch.equal(d[R + 2], s[2])


@pytest.mark.gpu
def test_resolve_and_copy_from_pinned_host_inside_a_captured_graph() -> None:
    """One graph: resolve the routing in a static buffer, copy the fetched rows from pinned
    host memory; replayed with changing routing, it equals the references run eagerly."""
    src = (torch.randn(8, 64, 256).to(torch.bfloat16).pin_memory(),
           torch.randn(8, 256, 32).to(torch.bfloat16).pin_memory())  # fmt: skip
    state = fresh_state()
    dst = tuple(torch.zeros(R + S, *s.shape[1:], dtype=s.dtype, device="cuda") for s in src)
    ids = torch.zeros(2, 2, dtype=torch.int64, device="cuda")
    ref_state = tuple(t.cpu().clone() for t in state)
    ref_dst = tuple(d.cpu().clone() for d in dst)
    warm = tuple(t.clone() for t in state)  # compile (and load) both kernels before capture
    resolve_slots(ids, SlotTable(*warm, R, ROW_BYTES))
    copy_fetched(warm[5], tuple(d.clone() for d in dst), src, R)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows = resolve_slots(ids, SlotTable(*state, R, ROW_BYTES))
        copy_fetched(state[5], dst, src, R)
    gen = torch.Generator().manual_seed(5)
    for _ in range(6):
        step_ids = torch.tensor([1, 4, 6, 9, 0, 2, 3, 5])[
            torch.randint(0, 8, (2, 2), generator=gen)
        ]
        cold = [e for e in step_ids.unique().tolist() if e not in (1, 4, 6, 9)]
        if len(cold) > S:
            continue
        ids.copy_(step_ids)
        graph.replay()
        expect = resolve_slots_ref(step_ids, SlotTable(*ref_state, R, ROW_BYTES))
        copy_fetched_ref(ref_state[5], ref_dst, src, R)
        torch.cuda.synchronize()
        assert torch.equal(rows.cpu(), expect)
        for a, b in zip(state, ref_state):
            assert torch.equal(a.cpu(), b)
        for a, b in zip(dst, ref_dst):
            assert torch.equal(a.cpu(), b)


def test_the_copy_wait_references_add_the_time_since_their_mark() -> None:
    """A join's end adds the time since the start; a copy's end (with the fetch list) only when
    a row was copied. Only the two clock columns change."""
    counters = torch.zeros(COUNTERS, dtype=torch.int64)
    before = time.monotonic_ns()
    copy_wait_start_ref(counters)
    assert before <= counters[COPY_WAIT_MARK] <= time.monotonic_ns()
    time.sleep(0.002)
    copy_wait_end_ref(counters)
    joined = int(counters[COPY_WAIT_NS])
    assert 2_000_000 <= joined < time.monotonic_ns() - before
    copy_wait_start_ref(counters)
    time.sleep(0.001)
    copy_wait_end_ref(counters, torch.full((S,), -1, dtype=torch.int32))  # nothing copied
    assert counters[COPY_WAIT_NS] == joined
    copy_wait_start_ref(counters)
    time.sleep(0.001)
    copy_wait_end_ref(counters, torch.tensor([-1, 5, -1], dtype=torch.int32))
    assert counters[COPY_WAIT_NS] >= joined + 1_000_000
    others = [i for i in range(COUNTERS) if i not in (COPY_WAIT_NS, COPY_WAIT_MARK)]
    assert not counters[others].any()


@pytest.mark.gpu
def test_the_clock_kernels_time_a_wait_on_the_stream() -> None:
    """`copy_wait_start`, a ~10 ms spin on the stream, `copy_wait_end`: the GPU's timer gives
    the spin's time, within the CUDA events around the three; an end with no fetched row adds
    nothing, one with a fetched row adds its wait."""
    counters = torch.zeros(COUNTERS, dtype=torch.int64, device=DEVICE)
    no_fetch = torch.full((S,), -1, dtype=torch.int32, device=DEVICE)
    copy_wait_start(counters)  # compile and load both before timing
    copy_wait_end(counters, no_fetch)
    copy_wait_end(counters)
    torch.cuda.synchronize()
    counters.zero_()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    events[0].record()
    copy_wait_start(counters)
    torch.cuda._sleep(20_000_000)  # cycles: ~10 ms at the H100's / H200's clocks
    copy_wait_end(counters)
    events[1].record()
    torch.cuda.synchronize()
    waited, spun = int(counters[COPY_WAIT_NS]), events[0].elapsed_time(events[1]) * 1e6
    assert 0.9 * spun < waited <= spun + 20_000, (waited, spun)
    copy_wait_start(counters)
    copy_wait_end(counters, no_fetch)
    assert int(counters[COPY_WAIT_NS]) == waited
    copy_wait_start(counters)
    torch.cuda._sleep(2_000_000)
    copy_wait_end(counters, torch.tensor([-1, 0, -1], dtype=torch.int32, device=DEVICE))
    assert int(counters[COPY_WAIT_NS]) > waited
    assert counters[COPY_WAIT_MARK] > 0 and not counters[:COPY_WAIT_NS].any()


def test_the_paged_forward_on_the_slot_kernels_equals_all_resident() -> None:
    """The pool's own kernels (interpreted on the CPU) under the paged forward: bit-identical
    logits to the all-resident model over prefill rounds and one-round decode steps."""
    import copy

    from dsv4.config.model import tiny_config
    from dsv4.model.tiny import random_model
    from dsv4.runner.paged import PoolOptions, pool_experts
    from kernels.backend import KernelBackendConfig
    from tests.engine.conftest import greedy_request, make_core
    from tests.engine.test_paged_forward import _lockstep_logits
    from tests.leak import assert_no_leaks

    cfg = tiny_config().with_overrides(num_nextn_predict_layers=0, num_hidden_layers=2,
                                       compress_ratios=(0, 4))  # fmt: skip
    resident = random_model(cfg, seed=9)
    pooled = copy.deepcopy(resident)
    kernels = KernelBackendConfig(overrides={"resolve_slots": "triton", "copy_fetched": "triton"})
    pool = pool_experts(pooled, PoolOptions((5,), max_decode_tokens=2), "cpu", kernels)
    cores = [make_core(m, budget=32, paged={}, max_num_seqs=2) for m in (resident, pooled)]
    for core in cores:
        core.add_request(greedy_request("a", list(range(3, 40)), 3))
        core.add_request(greedy_request("b", [7, 8, 9], 3))
    steps = _lockstep_logits(*cores)
    assert len(steps) >= 3 and all(torch.equal(a, b) for a, b in steps)
    pool.mirror()
    assert pool.stats().fetches > 0
    for core in cores:
        assert_no_leaks(core)
    assert_no_leaks(pool)
