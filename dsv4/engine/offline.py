"""Offline batch generation on the paged engine (`dsv4 generate` with one or many prompts)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4.cache.layout import KVLayout
from dsv4.cache.packing import CacheOptions
from dsv4.config.model import ModelConfig
from dsv4.engine.core import EngineOptions, build_engine_core
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.ops.sampling import SamplingSpec
from dsv4.runner.stop import TextStopChecker
from dsv4.scheduler.config import SchedulerConfig
from dsv4.scheduler.request import Request
from dsv4.text.tokenizer import TextCodec
from dsv4.types import RequestLimits, SamplingParams, TokenLogprobs
from dsv4.wire.validate import check_prompt_token_ids, check_sampling


@dataclass(frozen=True)
class OfflineResult:
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    finish_reason: str
    # one per output token when the spec asked (`SamplingSpec.logprobs`), else ()
    logprobs: tuple[TokenLogprobs, ...] = ()


def default_cache_options(dtype: torch.dtype, block_size: int = 256) -> CacheOptions:
    """fp32 models keep an exact fp32 cache (reference runs); others use the served formats."""
    if dtype == torch.float32:
        return CacheOptions(block_size=block_size, kv_dtype="fp32", index_dtype="fp32")
    return CacheOptions(block_size=block_size, kv_dtype="fp8", index_dtype="mxfp4")


def checked_params(
    cfg: ModelConfig,
    prompts: list[list[int]],
    spec: SamplingSpec,
    max_new_tokens: int,
    *,
    stop_strings: tuple[str, ...] = (),
) -> tuple[list[SamplingParams], str | None]:
    """The server's checks (dsv4.wire.validate) on every prompt and the sampling values, with
    max_new_tokens capped at the room the model's context leaves each prompt.

    Returns one SamplingParams per prompt and a one-line note when some prompt was capped;
    raises InvalidRequest naming the wire field (`sampling.top_p`, `prompt_token_ids`)."""
    limits = RequestLimits(vocab_size=cfg.vocab_size, max_model_len=cfg.max_position_embeddings)
    params, capped = [], 0
    for prompt in prompts:
        check_prompt_token_ids(prompt, limits)
        room = limits.max_model_len - len(prompt)
        capped += max_new_tokens > room
        params.append(
            check_sampling(
                temperature=spec.temperature,
                top_p=spec.top_p,
                top_k=spec.top_k,
                max_new_tokens=min(max_new_tokens, room),
                seed=spec.seed,
                logprobs=spec.logprobs,
                stop_token_ids=(),
                stop_strings=stop_strings,
                ignore_eos=False,
                num_prompt_tokens=len(prompt),
                limits=limits,
            )
        )
    note = None
    if capped:
        longest = max(len(p) for p in prompts)
        note = (
            f"max_new_tokens {max_new_tokens} capped for {capped} of {len(prompts)} prompts: "
            f"the model's context is {limits.max_model_len} positions (prompt + output), so "
            f"the longest prompt ({longest} tokens) gets {limits.max_model_len - longest}"
        )
    return params, note


def generate_batch(
    model: DeepseekV4,
    prompts: list[list[int]],
    specs: list[SamplingSpec],
    max_new_tokens: int | Sequence[int],
    *,
    stop_token_ids: tuple[int, ...] = (),
    stop_strings: tuple[str, ...] = (),
    codec: TextCodec | None = None,
    cache_options: CacheOptions | None = None,
    max_num_batched_tokens: int = 16384,
) -> list[OfflineResult]:
    """Run every prompt to completion with continuous batching; results in prompt order.

    `max_new_tokens` is one budget for all prompts or one per prompt."""
    device = model.embed.weight.device
    options = cache_options or default_cache_options(model.embed.weight.dtype)
    layout = KVLayout.build(model.cfg, options)
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else max_new_tokens
    longest = max(len(p) + n for p, n in zip(prompts, budgets))
    num_blocks = sum(layout.num_blocks_for_request(len(p) + n) for p, n in zip(prompts, budgets))
    sched = SchedulerConfig(
        max_num_batched_tokens=max(max_num_batched_tokens, len(prompts)),
        max_num_seqs=len(prompts),
        max_model_len=longest,
    )
    if stop_strings and codec is None:
        raise ValueError("stop strings need the tokenizer (codec) to detokenize outputs")
    checker = TextStopChecker(codec) if stop_strings else None
    core = build_engine_core(
        model, EngineOptions(options, sched, num_blocks, str(device)), stop_checker=checker
    )
    eos = model.cfg.eos_token_id if model.cfg.eos_token_id in stop_token_ids else None
    for i, (prompt, spec, budget) in enumerate(zip(prompts, specs, budgets)):
        core.add_request(
            Request(
                f"offline-{i}",
                tuple(prompt),
                max_new_tokens=budget,
                sampling_params=SamplingParams(
                    temperature=spec.temperature,
                    top_p=spec.top_p,
                    top_k=spec.top_k,
                    seed=spec.seed,
                    logprobs=spec.logprobs,
                    max_new_tokens=budget,
                    stop_strings=stop_strings,
                ),
                eos_token_id=eos,
                stop_token_ids=frozenset(stop_token_ids),
            )
        )
    outputs: dict[str, list[int]] = {}
    logprobs: dict[str, list[TokenLogprobs]] = {}
    reasons: dict[str, str] = {}
    while core.has_work():
        for out in core.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            logprobs.setdefault(out.request_id, []).extend(out.logprobs)
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason.value
    assert not core.find_leaks(), core.find_leaks()
    return [
        OfflineResult(
            tuple(p),
            tuple(outputs.get(f"offline-{i}", ())),
            reasons[f"offline-{i}"],
            tuple(logprobs.get(f"offline-{i}", ())),
        )
        for i, p in enumerate(prompts)
    ]
