"""IndexCache on the paged engine: with a pattern the engine's greedy output equals the
reference model's under the same pattern (one chunk and many), the Shared layer has no
indexer keys in the cache, and a model/layout mismatch fails loudly."""

from __future__ import annotations

import pytest
import torch

from dsv4.cache import INDEXER, CacheOptions
from dsv4.config.index_pattern import IndexPattern
from dsv4.engine.core import EngineOptions, build_engine_core
from dsv4.errors import StepFailed
from dsv4.model.generate import generate
from dsv4.scheduler.config import SchedulerConfig
from tests.engine.conftest import greedy_request, run_to_completion
from tests.leak import assert_no_leaks

PROMPT_LENS = (150, 7, 260)
NEW_TOKENS = 6


def core_with(model, pattern: str, budget: int):
    options = CacheOptions(block_size=128, kv_dtype="fp32", index_dtype="fp32",
                           index_pattern=pattern)  # fmt: skip
    sched = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=2048)
    return build_engine_core(model, EngineOptions(options, sched, 48))


def prompts(vocab: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(21)
    return {f"r{i}": torch.randint(2, vocab, (n,), generator=gen).tolist()
            for i, n in enumerate(PROMPT_LENS)}  # fmt: skip


@pytest.fixture(scope="module")
def shared_model(tiny):
    tiny.set_index_pattern(IndexPattern.from_freq(tiny.cfg, 2))  # FS: layer 3 reuses layer 1
    yield tiny
    tiny.set_index_pattern(IndexPattern.all_full(tiny.cfg))


@pytest.fixture(scope="module")
def reference(shared_model) -> dict[str, list[int]]:
    vocab = shared_model.cfg.vocab_size
    return {rid: generate(shared_model, p, NEW_TOKENS) for rid, p in prompts(vocab).items()}


@pytest.mark.parametrize("budget", [4096, 100], ids=["one-chunk", "chunks-100"])
def test_engine_with_index_cache_equals_reference(shared_model, reference, budget) -> None:
    core = core_with(shared_model, "FS", budget)
    layout = core.runner.cache.layout
    assert [r.layer_id for r in layout.regions if r.kind == INDEXER] == [1]
    for rid, prompt in prompts(shared_model.cfg.vocab_size).items():
        core.add_request(greedy_request(rid, prompt, NEW_TOKENS))
    assert run_to_completion(core) == reference
    assert_no_leaks(core)


def test_pattern_missing_from_the_layout_fails_loudly(shared_model) -> None:
    shared_model.set_index_pattern(IndexPattern.all_full(shared_model.cfg))
    try:
        core = core_with(shared_model, "FS", 4096)  # layer 3 has no indexer keys to read
        core.add_request(greedy_request("r", list(range(2, 40)), 2))
        with pytest.raises(StepFailed, match="index pattern") as failure:  # the step's cause
            run_to_completion(core)
        assert isinstance(failure.value.__cause__, RuntimeError)
        assert not core.has_work()
        assert_no_leaks(core)  # the failed request is freed
    finally:
        shared_model.set_index_pattern(IndexPattern.from_freq(shared_model.cfg, 2))


def test_prefill_benchmark_dry_run(tmp_path) -> None:
    """benchmarks/bench_prefill.py on CPU with the tiny model: one record per switch, and the
    metadata switch leaves the first token unchanged (the script asserts it)."""
    import json

    from benchmarks import bench_prefill as bench

    out = tmp_path / "prefill.json"
    assert bench.main(["--dry-run", "--lengths", "130", "--out", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [r["name"] for r in records] == [
        "ttft/index_cache_f2", "ttft/index_cache_f4", "ttft/shared_sparse_metadata", "ttft/all_on",
    ]  # fmt: skip
    keys = {"name", "shape", "time_us", "baseline", "baseline_time_us", "speedup", "pct_roofline"}
    assert all(set(r) == keys and r["time_us"] > 0 for r in records)
