"""Measure MTP acceptance per draft position by serving prompts through the paged engine."""

from __future__ import annotations

import dataclasses

from dsv4.cache.packing import CacheOptions
from dsv4.engine.core import EngineOptions, build_engine_core
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.scheduler.config import SchedulerConfig
from dsv4.scheduler.request import Request
from dsv4.speculative.metrics import SpecMetrics
from dsv4.types import SamplingParams


def measure_acceptance(
    model: DeepseekV4,
    prompts: list[list[int]],
    num_speculative_tokens: int,
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    max_steps: int = 100_000,
    paged: bool = False,
) -> tuple[SpecMetrics, dict[str, list[int]]]:
    """Run every prompt to `max_new_tokens` with k drafts (greedy unless `sampling`; EOS
    ignored) on an exact fp32 cache -> (acceptance counters, output ids per request).
    `paged`: the serving path (the paged forward's speculative half, its decode steps as the
    static passes CUDA graphs replay) instead of the reference forward's. A seeded `sampling`
    gives request i the seed + i."""
    k = num_speculative_tokens
    options = CacheOptions(block_size=128, kv_dtype="fp32", index_dtype="fp32",
                           num_speculative_tokens=k)  # fmt: skip
    longest = max(len(p) for p in prompts) + max_new_tokens
    config = SchedulerConfig(
        max_num_batched_tokens=max(512, len(prompts) * (1 + k)),
        max_num_seqs=len(prompts),
        max_model_len=longest + k,
        num_speculative_tokens=k,
    )
    blocks = len(prompts) * (2 + longest // 128) + 16 * len(prompts)
    paged_options = None
    if paged:
        from dsv4.runner.paged.decode_graphs import GraphOptions
        from dsv4.runner.paged.step_forward import PagedOptions

        graphs = GraphOptions(max_batch=len(prompts), max_model_len=config.max_model_len,
                              capture=model.embed.weight.is_cuda)  # fmt: skip
        paged_options = PagedOptions(graphs=graphs)
    device = str(model.embed.weight.device)
    core = build_engine_core(model, EngineOptions(options, config, blocks, device,
                                                  paged=paged_options))  # fmt: skip
    for i, prompt in enumerate(prompts):
        params = (
            sampling
            if sampling is None
            else dataclasses.replace(sampling, seed=(sampling.seed or 0) + i)
        )
        core.add_request(Request(f"m{i}", tuple(prompt), max_new_tokens, params))
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not core.has_work():
            break
        for out in core.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    metrics = core.runner.spec_metrics
    assert metrics is not None
    return metrics, outputs
