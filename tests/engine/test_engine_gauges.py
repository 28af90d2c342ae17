"""`AsyncEngine.load()`, what the workers' engine gauges (`vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`) read at scrape time: taken before a
stream or a caller hears of a step or command, never one step behind, and refreshed after a
step that failed (an idle engine takes no further step to catch up)."""

from __future__ import annotations

import asyncio
import threading
import time

from dsv4.engine.async_engine import AsyncEngine
from dsv4.engine.core import EngineCore
from dsv4.errors import StepFailed
from tests.engine.conftest import greedy_request, make_core
from tests.engine.test_engine_faults import faulty_core
from tests.leak import assert_no_leaks

PROMPT = [5, 9, 200, 17, 33, 41, 7, 300, 12, 99, 4, 8]
SLOW_LOAD_S = 0.3  # far longer than the event loop takes to wake a reader


class SlowLoadCore(EngineCore):
    """A core whose `load()` takes SLOW_LOAD_S on the engine thread while `slow` is set: a
    load taken after the stream or caller was told would be read stale in that window."""

    slow = False

    def load(self):
        if self.slow and threading.current_thread() is not threading.main_thread():
            time.sleep(SLOW_LOAD_S)
        return super().load()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def _idle(load) -> bool:
    return (
        load.num_running == 0 and load.num_waiting == 0
        and load.num_free_blocks == load.num_total_blocks
    )  # fmt: skip


async def _until_idle(engine: AsyncEngine) -> None:
    for _ in range(300):
        if _idle(engine.load()):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the engine never went idle: {engine.load()}")


def test_load_is_current_when_the_stream_or_the_caller_hears(tiny) -> None:
    async def main() -> None:
        built = make_core(tiny)
        core = SlowLoadCore(built.scheduler, built.runner)
        engine = AsyncEngine(core)
        engine.start()
        try:
            core.slow = True
            await engine.call(lambda: core.add_request(greedy_request("queued", PROMPT, 2)))
            load = engine.load()  # the request was added, no step has run it yet
            assert (load.num_waiting, load.num_running) == (1, 0), load
            await _until_idle(engine)
            async for out in engine.generate(greedy_request("a", PROMPT, 3)):
                if out.finish_reason is not None:
                    load = engine.load()  # read the moment the last token arrives
            assert _idle(load), load  # "a" is gone already, its blocks free
        finally:
            await engine.stop()
        assert_no_leaks(engine.core)

    run(main())


def test_load_after_a_failed_step_shows_its_requests_gone(tiny) -> None:
    async def main() -> None:
        core, runner = faulty_core(tiny)
        engine = AsyncEngine(core)
        engine.start()
        try:
            runner.poisoned = frozenset({"bad"})
            try:
                async for _ in engine.generate(greedy_request("bad", PROMPT, 4)):
                    pass
                raise AssertionError("the poisoned step did not fail")
            except StepFailed:
                pass
            await asyncio.sleep(0.2)  # the engine idles: no step or command refreshes the load
            assert _idle(engine.load()), engine.load()
        finally:
            await engine.stop()
        assert_no_leaks(engine.core)

    run(main())
