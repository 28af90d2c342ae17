"""AsyncEngine: streaming over asyncio, prefill-only holds, adopt/activate, abort, stop."""

from __future__ import annotations

import asyncio

import pytest

from dsv4.engine.async_engine import AsyncEngine
from dsv4.errors import Cancelled
from dsv4.model.generate import generate
from dsv4.scheduler.request import FinishCause
from tests.engine.conftest import greedy_request, make_core
from tests.leak import assert_no_leaks

PROMPT = [5, 9, 200, 17, 33, 41, 7, 300, 12, 99, 4, 8]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def test_generate_streams_reference_tokens(tiny) -> None:
    expected = generate(tiny, PROMPT, 6)

    async def main():
        engine = AsyncEngine(make_core(tiny))
        engine.start()
        try:
            got, reasons = [], []
            async for out in engine.generate(greedy_request("a", PROMPT, 6)):
                got.extend(out.new_token_ids)
                reasons.append(out.finish_reason)
            return got, reasons
        finally:
            await engine.stop()
            assert_no_leaks(engine.core)

    got, reasons = run(main())
    assert got == expected
    assert reasons[-1] is FinishCause.LENGTH and all(r is None for r in reasons[:-1])


def test_prefill_hold_then_adopt_on_another_engine(tiny) -> None:
    """P prefills and holds; D adopts, copies P's blocks, activates: same tokens as one engine."""
    expected = generate(tiny, PROMPT, 5)

    async def main():
        prefill, decode = AsyncEngine(make_core(tiny), "p"), AsyncEngine(make_core(tiny), "d")
        prefill.start()
        decode.start()
        try:
            outcome = await prefill.prefill(greedy_request("a", PROMPT, 5))
            assert outcome.held is not None and outcome.finish_reason is FinishCause.LENGTH
            request = greedy_request("a", PROMPT, 5)
            request.output_token_ids.append(outcome.first_token)
            dst = await decode.adopt(request)
            assert len(dst) == len(outcome.held.block_ids)
            src_cache, dst_cache = prefill.core.runner.cache, decode.core.runner.cache
            for s, d in zip(outcome.held.block_ids, dst):
                dst_cache.backing[d] = src_cache.backing[s]
            assert await prefill.release_hold("a")
            tokens = [outcome.first_token]
            async for out in decode.activate("a"):
                tokens.extend(out.new_token_ids)
            return tokens
        finally:
            await prefill.stop()
            await decode.stop()
            assert_no_leaks(prefill.core, decode.core)

    assert run(main()) == expected


def test_abort_and_early_consumer_exit_free_everything(tiny) -> None:
    async def main():
        engine = AsyncEngine(make_core(tiny))
        engine.start()
        try:
            stream = engine.generate(greedy_request("a", PROMPT, 50))
            await stream.__anext__()
            await engine.abort("a")
            with pytest.raises(Cancelled):
                async for _ in stream:
                    pass
            early = engine.generate(greedy_request("b", PROMPT, 50))
            await early.__anext__()
            await early.aclose()  # the consumer leaves: the engine aborts b by itself
            for _ in range(100):
                if not engine.core.has_work():
                    break
                await asyncio.sleep(0.02)
        finally:
            await engine.stop()
            assert_no_leaks(engine.core)

    run(main())
