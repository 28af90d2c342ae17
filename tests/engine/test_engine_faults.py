"""Fault isolation and KV back-pressure in the engine: a step that raises ends only its own
requests (blocks, prefill holds and adopted requests freed) and the engine goes on; a decode
pool that outgrows its blocks preempts by recompute instead of stalling; health follows
whether the engine can step. Every test ends with a leak check."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dsv4.config import ServeConfig
from dsv4.engine.async_engine import MAX_CONSECUTIVE_STEP_FAILURES, AsyncEngine
from dsv4.engine.core import EngineCore
from dsv4.errors import InvalidRequest, OutOfBlocks, StepFailed, Unavailable, to_grpc_status
from dsv4.model.generate import generate
from dsv4.runner.model_runner import ModelRunner
from dsv4.scheduler.batch import RequestStepOutput, ScheduledBatch, StepOutput
from dsv4.worker.server import bind_port, follow_engine_health, make_server
from tests.engine.conftest import greedy_request, make_core, run_to_completion
from tests.leak import assert_no_leaks

PROMPT = [5, 9, 200, 17, 33, 41, 7, 300, 12, 99, 4, 8]
SERVICE = "dsv4.v1.DecodeWorker"


class FaultyRunner(ModelRunner):
    """The real runner, except that a step raises while `fail_all` is set or while it carries
    one of `poisoned` (as a device fault or a sampler error would), or (`garbled`) returns
    more tokens than were scheduled, so that `Scheduler.update` raises."""

    poisoned: frozenset[str] = frozenset()
    garbled: frozenset[str] = frozenset()
    fail_all = False

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        ids = {r.request_id for r in batch.requests}
        if self.fail_all or ids & self.poisoned:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        out = super().execute(batch)
        return StepOutput(
            tuple(
                RequestStepOutput(o.request_id, o.new_token_ids * 3)
                if o.request_id in self.garbled
                else o
                for o in out.outputs
            )
        )


def faulty_core(model, **options: object) -> tuple[EngineCore, FaultyRunner]:
    built = make_core(model, **options)
    runner = FaultyRunner(built.runner.forward, built.runner.sampler, built.runner.cache)
    return EngineCore(built.scheduler, runner), runner


def num_ring_blocks(model) -> int:
    return make_core(model).kv.layout.num_ring_blocks


def test_failed_step_ends_only_its_requests_and_the_engine_goes_on(tiny) -> None:
    core, runner = faulty_core(tiny, max_num_seqs=2, budget=64)
    runner.poisoned = frozenset({"bad"})
    core.add_request(greedy_request("bad", PROMPT, 4))
    core.add_request(greedy_request("bystander", PROMPT[:5], 4))
    core.add_request(greedy_request("queued", PROMPT, 4))  # max_num_seqs 2: not in the step
    with pytest.raises(StepFailed) as failure:
        core.step()
    assert set(failure.value.request_ids) == {"bad", "bystander"}
    assert "RuntimeError: probability tensor" in failure.value.message
    assert to_grpc_status(failure.value)[0] is grpc.StatusCode.INTERNAL
    assert core.scheduler.request_ids() == ("queued",)
    # the next steps schedule afresh ("schedule() called twice" before) and serve the rest
    core.add_request(greedy_request("after", PROMPT[:7], 3))
    outputs = run_to_completion(core)
    assert outputs == {"queued": generate(tiny, PROMPT, 4), "after": generate(tiny, PROMPT[:7], 3)}
    assert_no_leaks(core)


def test_failed_update_releases_the_prefill_holds_of_its_step(tiny) -> None:
    core, runner = faulty_core(tiny)
    runner.garbled = frozenset({"p"})  # the runner's answer makes update() raise
    core.add_request(greedy_request("p", PROMPT, 4), prefill_only=True)
    core.add_request(greedy_request("other", PROMPT[:6], 2), prefill_only=True)
    with pytest.raises(StepFailed) as failure:
        core.step()
    assert set(failure.value.request_ids) == {"p", "other"}
    assert not core.held and not core.has_work()
    assert_no_leaks(core)


def test_failed_step_frees_an_activated_adopted_request(tiny) -> None:
    core, runner = faulty_core(tiny)
    core.adopt(_with_first(greedy_request("adopted", PROMPT, 5), 7))
    core.activate("adopted")
    runner.poisoned = frozenset({"adopted"})
    with pytest.raises(StepFailed):
        core.step()
    assert not core.has_work()
    assert_no_leaks(core)


def _prefilled(model, prompt: list[int], n: int, rid: str) -> tuple[EngineCore, object, object]:
    """P's side: a prefill-only core holding `rid`'s prompt KV and its first token."""
    core = make_core(model)
    core.add_request(greedy_request(rid, prompt, n), prefill_only=True)
    run_to_completion(core)
    return core, core.held[rid], core.runner.cache


def test_decode_pool_out_of_blocks_preempts_by_recompute_instead_of_stalling(tiny) -> None:
    """Two adopted requests that together outgrow the pool (each alone fits): the older one
    preempts the other, which is recomputed from prompt + tokens so far through its own
    prefill path; both finish with the reference tokens (before: both stalled for good). While
    a preempted request waits, adopt refuses newcomers: the preempted one has first claim."""
    prompts, n = {"a": PROMPT * 8, "b": PROMPT[::-1] * 8}, 60  # 96 + 60 tokens: 2 token blocks
    ring = num_ring_blocks(tiny)
    decode = make_core(tiny, num_blocks=2 * ring + 2)  # both prompts; they grow past it
    tokens: dict[str, list[int]] = {}
    for rid, prompt in prompts.items():
        prefill, held, src = _prefilled(tiny, prompt, n, rid)
        request = greedy_request(rid, prompt, n)
        request.output_token_ids.append(held.first_token)
        for s, d in zip(held.block_ids, decode.adopt(request)):
            decode.runner.cache.backing[d] = src.backing[s]
        prefill.release_hold(rid)
        assert_no_leaks(prefill)
        decode.activate(rid)
        tokens[rid] = [held.first_token]
    with pytest.raises(OutOfBlocks):  # a third one: no blocks left, nothing taken
        decode.adopt(_with_first(greedy_request("c", PROMPT * 8, n), 1))
    refused_while_preempted = False
    for _ in range(400):
        if not decode.has_work():
            break
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
        if decode.scheduler.num_preempted_waiting and not refused_while_preempted:
            with pytest.raises(OutOfBlocks, match="preempted requests wait"):
                decode.adopt(_with_first(greedy_request("d", PROMPT, 2), 1))
            refused_while_preempted = True
    assert refused_while_preempted and decode.num_preemptions >= 1
    assert tokens == {rid: generate(tiny, p, n) for rid, p in prompts.items()}
    assert decode.scheduler.num_waiting == 0
    assert_no_leaks(decode)


def test_adopt_refuses_a_request_that_never_fits(tiny) -> None:
    core = make_core(tiny, num_blocks=num_ring_blocks(tiny) + 1)
    with pytest.raises(InvalidRequest, match="never fit"):
        core.adopt(_with_first(greedy_request("huge", PROMPT, 200), 1))  # 212 > 128 positions
    assert_no_leaks(core)


def _with_first(request, token: int):
    request.output_token_ids.append(token)
    return request


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def test_async_engine_fails_the_step_streams_and_reports_when_it_cannot_step(tiny) -> None:
    async def collect(engine: AsyncEngine, rid: str, prompt: list[int], n: int):
        tokens: list[int] = []
        try:
            async for out in engine.generate(greedy_request(rid, prompt, n)):
                tokens.extend(out.new_token_ids)
        except StepFailed as exc:
            return exc
        return tokens

    async def main() -> None:
        core, runner = faulty_core(tiny)
        engine = AsyncEngine(core)
        engine.start()
        server, health = make_server(ServeConfig(), (SERVICE,))
        port = bind_port(server, ServeConfig(), "127.0.0.1", 0)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        health_stub = health_pb2_grpc.HealthStub(channel)
        await server.start()
        following = asyncio.create_task(
            follow_engine_health(health, (SERVICE,), lambda: engine.can_step, interval_s=0.01)
        )

        async def serving() -> bool:
            await asyncio.sleep(0.05)  # two rounds of the follower
            reply = await health_stub.Check(health_pb2.HealthCheckRequest(service=SERVICE))
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        try:
            runner.poisoned = frozenset({"bad"})
            failed = await collect(engine, "bad", PROMPT, 4)
            assert isinstance(failed, StepFailed) and failed.request_ids == ("bad",)
            assert engine.can_step and await serving()  # one failure: still serving
            assert await collect(engine, "good", PROMPT, 4) == generate(tiny, PROMPT, 4)
            runner.fail_all = True
            for i in range(MAX_CONSECUTIVE_STEP_FAILURES):
                assert isinstance(await collect(engine, f"doomed{i}", PROMPT, 2), StepFailed)
            assert not engine.can_step and not await serving()
            runner.fail_all = False  # the fault clears: the idle engine's probe finds out
            give_up_s = time.monotonic() + 10
            while not engine.can_step:
                assert time.monotonic() < give_up_s, "the engine never probed its way back"
                await asyncio.sleep(0.05)
            assert await serving()
            assert await collect(engine, "again", PROMPT, 3) == generate(tiny, PROMPT, 3)
            assert engine.num_step_failures >= MAX_CONSECUTIVE_STEP_FAILURES + 1
        finally:
            await engine.stop()
            assert not engine.can_step and not await serving()  # a stopped engine neither
            following.cancel()
            await channel.close()
            await server.stop(None)
        assert_no_leaks(engine.core)

    run(main())


class DyingCore(EngineCore):
    """A core whose bookkeeping raises outside any step once `dying` is set (a bug that
    kills the engine thread)."""

    dying = False

    def load(self):
        if self.dying:
            raise SystemError("bookkeeping bug")
        return super().load()


def test_a_dead_engine_thread_fails_its_streams_and_cannot_step(tiny) -> None:
    async def main() -> None:
        built = make_core(tiny)
        core = DyingCore(built.scheduler, built.runner)
        engine = AsyncEngine(core)
        engine.start()
        stream = engine.generate(greedy_request("a", PROMPT, 200))
        await anext(stream)
        core.dying = True
        with pytest.raises(Unavailable, match="engine thread died: SystemError"):
            async for _ in stream:
                pass
        assert not engine.can_step
        with pytest.raises(Unavailable, match="not running"):
            await engine.call(lambda: None)
        await engine.stop()  # a worker's shutdown still completes
        core.dying = False
        core.abort("a")  # the thread is gone: free what it left behind by hand
        assert_no_leaks(core)

    run(main())
