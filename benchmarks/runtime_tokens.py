"""Greedy continuations from a `WorkerRuntime` (the engine a worker serves with), run
in-process through its `AsyncEngine`, ending with the scheduler's leak check. Tests and the GPU
checks share it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from dsv4.types import GenerateRequest, SamplingParams


def runtime_greedy_tokens(
    runtime, prompts: Sequence[Sequence[int]], new_tokens: int,
    sampling: Sequence[dict] | None = None,
) -> list[list[int]]:  # fmt: skip
    """Every prompt at once (one batch), `new_tokens` greedy tokens each (EOS ignored);
    `sampling[i]`: more SamplingParams fields for prompt i (e.g. penalties)."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    extra = sampling or [{}] * len(prompts)

    async def one(i: int, prompt: Sequence[int]) -> list[int]:
        params = dataclasses.replace(greedy, **extra[i])
        request = runtime.engine_request(GenerateRequest(f"r{i}", tuple(prompt), params))
        return [t async for out in runtime.engine.generate(request) for t in out.new_token_ids]

    async def run_all() -> list[list[int]]:
        runtime.engine.start()
        try:
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
        finally:
            await runtime.engine.stop()

    tokens = asyncio.run(run_all())
    runtime.engine.core.scheduler.check_no_leaks()
    return tokens
