"""Per-step sparse-index metadata (dsv4.runner.reference.slot_tables): the tables against the builders'
references, and the fast paged gather (`load_states`, tables shared by all layers or rebuilt
per layer) against the per-request reference `load_state`: identical states."""

from __future__ import annotations

import pytest
import torch

from dsv4.cache import CacheOptions, KVCacheManager, KVLayout
from dsv4.config.model import tiny_config
from dsv4.runner.kv_cache import PagedKVCache
from dsv4.runner.reference.cache_state import load_state, load_states
from dsv4.runner.reference.slot_tables import build_slot_tables, c4_topk_slots
from dsv4.scheduler.batch import ScheduledRequest
from kernels.metadata import c4_global_topk_slots_ref

CFG = tiny_config().with_overrides(num_nextn_predict_layers=0)
# (start position, tokens this step): a fresh prefill, decodes, a chunk deep into the prompt.
SHAPES = ((0, 5), (37, 1), (300, 64), (129, 1))


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def filled_cache(pattern: str = "") -> tuple[PagedKVCache, tuple[ScheduledRequest, ...]]:
    """A paged cache whose requests hold random rows for every position before their start."""
    options = CacheOptions(block_size=128, kv_dtype="fp32", index_dtype="fp32",
                           index_pattern=pattern)  # fmt: skip
    layout = KVLayout.build(CFG, options)
    manager = KVCacheManager(layout, 64)
    cache = PagedKVCache(layout, 64)
    gen = torch.Generator().manual_seed(0)
    requests = []
    for i, (start, n) in enumerate(SHAPES):
        rid = f"r{i}"
        manager.allocate(rid, start + n)
        table, rings = manager.block_table(rid), manager.ring_block_ids(rid)
        for region in layout.regions:
            dim = region.entry_bytes // 4
            if region.is_ring and start:
                rows = torch.randn(start, dim, generator=gen)
                cache.write_ring(region.layer_id, region.kind, rings, 0, rows)
            elif not region.is_ring:
                num = start // CFG.layer_ratio(region.layer_id)
                rows = torch.randn(num, dim, generator=gen)
                cache.write_entries(region.layer_id, region.kind, table, 0, rows)
        ids = tuple(range(n))
        requests.append(ScheduledRequest(rid, ids, start, n > 1, 0, True, table, rings))
    return cache, tuple(requests)


def states_equal(a, b) -> bool:
    def same(x, y) -> bool:
        return (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))

    for la, lb in zip(a.layers, b.layers):
        if not same(la.window, lb.window):
            return False
        for name in ("compressor", "indexer"):
            ca, cb = getattr(la, name), getattr(lb, name)
            if (ca is None) != (cb is None):
                return False
            if ca is not None and not all(map(same, ca._tensors(), cb._tensors())):
                return False
    return a.num_tokens == b.num_tokens


@pytest.mark.parametrize("pattern", ["", "FS"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-layer"])
def test_fast_gather_equals_the_reference_load(pattern: str, shared: bool) -> None:
    cache, requests = filled_cache(pattern)
    fast = load_states(cache, requests, torch.float32, shared_metadata=shared)
    for req, state in zip(requests, fast):
        assert states_equal(state, load_state(cache, req, torch.float32)), req.request_id
        assert (state.layers[3].indexer is None) == (pattern == "FS")


def test_tables_match_their_definitions() -> None:
    cache, requests = filled_cache()
    meta = build_slot_tables(cache.layout, requests, "cpu")
    assert meta.first_tokens == (0, 5, 6, 70) and meta.positions.shape == (71,)
    assert meta.token_to_req.tolist() == [0] * 5 + [1] + [2] * 64 + [3]
    ring = cache.layout.region(0, "window").ring_slots
    w = CFG.sliding_window
    for t, p in enumerate(meta.positions.tolist()):
        lo = max(0, p - w + 1)
        expect = [q % ring for q in range(lo, p + 1)]
        assert meta.window_slots[t, : len(expect)].tolist() == expect
        assert (meta.window_slots[t, len(expect) :] == -1).all()
        b = int(meta.token_to_req[t])
        for ratio, epb in ((4, 32), (128, 1)):
            n = (p + 1) // ratio
            table = requests[b].block_table
            expect = [table[i // epb] * epb + i % epb for i in range(n)]
            assert meta.entry_slots[ratio][t, :n].tolist() == expect
            assert int(meta.entry_lens[ratio][t]) == n


def test_c4_translation_is_the_kernel_reference() -> None:
    cache, requests = filled_cache()
    meta = build_slot_tables(cache.layout, requests, "cpu")
    gen = torch.Generator().manual_seed(1)
    local = torch.randint(-1, 90, (71, CFG.index_topk), generator=gen, dtype=torch.int32)
    got = c4_topk_slots(meta, local, cache.layout)
    want = c4_global_topk_slots_ref(local, meta.token_to_req, meta.block_tables, 32)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
