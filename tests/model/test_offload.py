"""Expert offload on CPU with a simulated device budget (few cache slots): outputs equal the
resident path bit for bit, and the hit / miss counters follow the cache policy."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from dsv4.model.generate import generate
from dsv4.model.moe import MoE
from dsv4.model.offload import (
    ExpertFormat,
    OffloadedExperts,
    OffloadPolicy,
    expert_blob,
    mxfp4_dequantize_lut,
    offload_model,
    offload_stats,
)
from dsv4.ops.moe import swiglu
from dsv4.ops.quant import mxfp4_dequantize, mxfp4_quantize
from tests.model.conftest import tiny_model

PROMPT = [5, 17, 300, 42, 42, 7, 999, 64, 3, 128, 511, 2, 77, 19, 640, 33]


@pytest.fixture(scope="module")
def resident():
    return tiny_model(seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lut_dequantize_equals_reference(dtype):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 0.05
    packed, scale = mxfp4_quantize(w)
    assert torch.equal(
        mxfp4_dequantize_lut(packed, scale, dtype), mxfp4_dequantize(packed, scale, dtype)
    )


@torch.no_grad()
def test_offloaded_model_is_token_identical(resident):
    offloaded = copy.deepcopy(resident)
    stores = offload_model(offloaded, num_offloaded=5, cache_slots=2)
    assert len(stores) == 5 and not len(offloaded.layers[1].ffn.experts)  # 4 layers + MTP
    ids = torch.tensor(PROMPT)
    torch.testing.assert_close(offloaded(ids).logits, resident(ids).logits, rtol=0, atol=0)
    assert generate(offloaded, PROMPT, 10) == generate(resident, PROMPT, 10)
    stats = offload_stats(offloaded)
    assert stats.resident_hits > 0 and stats.misses > 0 and stats.cache_hits > 0
    assert stats.uses == stats.resident_hits + stats.cache_hits + stats.misses
    assert 0 < stats.hit_rate < 1 and stats.bytes_fetched == stats.misses * stores[0].fmt.nbytes


@torch.no_grad()
def test_mxfp4_blobs_and_cpu_compute_are_identical(resident):
    model = copy.deepcopy(resident)  # experts as an MXFP4 checkpoint would load them
    for m in model.modules():
        if isinstance(m, MoE):
            for ex in m.experts:
                for lin in (ex.w1, ex.w2, ex.w3):
                    lin.weight.copy_(mxfp4_dequantize(*mxfp4_quantize(lin.weight), torch.float32))
    offloaded = copy.deepcopy(model)
    cpu_first = OffloadPolicy(eviction="lfu", cpu_compute_max_tokens=2, cpu_gflops=1e9)
    offload_model(offloaded, num_offloaded=6, cache_slots=1, fmt="mxfp4", policy=cpu_first)
    ids = torch.tensor(PROMPT)
    torch.testing.assert_close(offloaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    stats = offload_stats(offloaded)
    assert stats.cpu_computes > 0 and stats.misses > 0  # few-token misses ran on the "CPU"


def _store(eviction: str, slots: int = 2):
    gen = torch.Generator().manual_seed(1)
    dim, inter = 32, 16
    fmt = ExpertFormat.dense(dim, inter, torch.float32)
    weights = [
        tuple(
            torch.randn(shape, generator=gen)
            for shape in ((inter, dim), (dim, inter), (inter, dim))
        )
        for _ in range(8)
    ]
    blobs = [expert_blob(fmt, *w, torch.device("cpu")) for w in weights]
    store = OffloadedExperts(
        fmt, [0, 1], torch.stack(blobs[:2]), {e: blobs[e] for e in range(2, 8)}, slots, 10.0,
        torch.device("cpu"), OffloadPolicy(eviction=eviction),
    )  # fmt: skip
    return store, weights


def _step(store, weights, experts):
    store.prepare(torch.tensor([experts]))
    u = torch.randn(3, 32)
    for e in sorted(experts):
        assert torch.equal(store.expert(e, 3)(u), swiglu(u, *weights[e], 10.0))


def test_lru_and_lfu_counters():
    store, w = _store("lru")
    _step(store, w, [2, 3])  # 2 misses fill both slots
    _step(store, w, [2, 4])  # 2 hits; 4 evicts 3 (protected: 2)
    _step(store, w, [0, 3])  # 0 resident; 3 evicts the least recently used of {2, 4}
    s = store.stats
    assert (s.resident_hits, s.cache_hits, s.misses) == (1, 1, 4)
    assert sorted(store.slots.where) in ([3, 4], [2, 3])
    store, w = _store("lfu")
    for experts in ([2, 3], [2, 4], [2, 5]):  # 2 is selected every step: LFU never evicts it
        _step(store, w, experts)
    assert 2 in store.slots.where and store.stats.cache_hits == 2


def test_more_misses_than_slots_reuses_slots_within_a_step():
    store, w = _store("lru", slots=1)
    _step(store, w, [2, 3, 4, 5, 6, 7])
    assert store.stats.misses == 6 and store.stats.cache_hits == 0


def test_benchmark_dry_run(tmp_path):
    from benchmarks import bench_offload as bench

    out = tmp_path / "offload.json"
    assert bench.main(["--dry-run", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {r["batch"] for r in result["runs"]} == {1, 16}
    for run in result["runs"]:
        assert run["tpot_ms"] > 0 and run["ttft_ms"] > 0 and 0 <= run["hit_rate"] <= 1
    assert result["offloaded_per_layer"] > 0 and result["identical_to_resident"] is True
