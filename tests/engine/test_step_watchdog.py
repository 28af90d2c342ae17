"""The step watchdog: a step that never returns is declared hung after `step_timeout_s`; every
live stream ends UNAVAILABLE, new work is refused at once, health says NOT_SERVING and Info says
draining; when the step returns after all its outputs are dropped, the requests ended for it are
freed, and a probe step brings the worker back. The hang is real: the runner's step waits on a
`threading.Event` the test sets (`HeldRunner`). Every test ends with a leak check."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_svc.servicer import DecodeService
from dsv4 import wire
from dsv4.config import load_config
from dsv4.engine.async_engine import AsyncEngine
from dsv4.engine.core import EngineCore
from dsv4.errors import StepHung, to_grpc_status
from dsv4.model.generate import generate
from dsv4.rpc.v1 import worker_pb2, worker_pb2_grpc
from dsv4.runner.model_runner import ModelRunner
from dsv4.scheduler.batch import ScheduledBatch, StepOutput
from dsv4.types import DecodeRequest, GenerateRequest, SamplingParams, WorkerRole
from dsv4.worker.build import build_worker_runtime
from dsv4.worker.identity import WorkerIdentity
from dsv4.worker.server import bind_port, follow_engine_health, make_server, set_serving
from tests.engine.conftest import greedy_request, make_core
from tests.leak import assert_no_leaks

PROMPT = [5, 9, 200, 17, 33, 41, 7, 300, 12, 99, 4, 8]
TIMEOUT_S = 1.0
MARGIN_S = 3.0  # the watchdog looks every quarter timeout; health followers every 0.01-0.25 s;
# the rest is room for a loaded 2-core CI machine (1.5 failed once under load)
HOLD_LIMIT_S = 30.0  # a failing test never leaves the engine thread held for longer


class HeldRunner(ModelRunner):
    """The real runner, except that once `hold` is set the next step waits (its thread blocked,
    as on a kernel or collective that never returns) until `release` is set or `hold_s`
    passed, then runs."""

    def __init__(self, runner: ModelRunner) -> None:
        super().__init__(runner.forward, runner.sampler, runner.cache)
        self.hold, self.entered, self.release = (threading.Event() for _ in range(3))
        self.hold_s = HOLD_LIMIT_S

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        if self.hold.is_set():
            self.hold.clear()
            self.entered.set()
            self.release.wait(self.hold_s)
        return super().execute(batch)

    def hold_for(self, seconds: float) -> None:
        """Hold the next step for `seconds` (a slow step, not a hung one)."""
        self.hold_s = seconds
        self.release.clear()
        self.entered.clear()
        self.hold.set()

    async def hold_next(self) -> None:
        """Hold the next step until `release`; returns once a step is held."""
        self.hold_s = HOLD_LIMIT_S
        self.release.clear()
        self.entered.clear()
        self.hold.set()
        assert await asyncio.to_thread(self.entered.wait, 10.0), "no step started"


def held_core(model, **options: object) -> tuple[EngineCore, HeldRunner]:
    built = make_core(model, **options)
    runner = HeldRunner(built.runner)
    return EngineCore(built.scheduler, runner), runner


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


async def wait_until(condition, what: str, timeout_s: float) -> float:
    """Seconds until `condition()` held (polled every 10 ms); fails after `timeout_s`."""
    started_s = time.monotonic()
    while not condition():
        assert time.monotonic() - started_s < timeout_s, f"{what} not within {timeout_s} s"
        await asyncio.sleep(0.01)
    return time.monotonic() - started_s


async def collect(stream) -> tuple[list[int], BaseException | None]:
    """The tokens a stream yielded, and the error that ended it (None: it finished)."""
    tokens: list[int] = []
    try:
        async for out in stream:
            tokens.extend(out.new_token_ids)
    except StepHung as exc:
        return tokens, exc
    return tokens, None


def test_a_hung_step_ends_every_stream_and_its_late_results_are_dropped(tiny, caplog) -> None:
    async def main() -> None:
        core, runner = held_core(tiny, max_num_seqs=2)  # "c" waits: not in the hung step
        engine = AsyncEngine(core, step_timeout_s=TIMEOUT_S)
        engine.start()
        try:
            runner.hold_for(0.2)  # slow but under the timeout: served as usual
            assert await collect(engine.generate(greedy_request("slow", PROMPT, 3))) == (
                generate(tiny, PROMPT, 3), None,
            )  # fmt: skip
            assert runner.entered.is_set() and engine.num_hung_steps == 0 and engine.can_step

            streams = {rid: engine.generate(greedy_request(rid, PROMPT, 200)) for rid in "abc"}
            first = list((await anext(streams["a"])).new_token_ids)  # "a" decodes
            tasks = {rid: asyncio.ensure_future(collect(s)) for rid, s in streams.items()}
            load = engine.load
            await wait_until(lambda: (load().num_running, load().num_waiting) == (2, 1), "b, c", 5)
            await runner.hold_next()
            assert engine.can_step  # held, but not for long yet
            # a request that comes now waits for the held step: it ends with the others and
            # its add is dropped (it would run unobserved after the step returns)
            tasks["late"] = asyncio.ensure_future(
                collect(engine.generate(greedy_request("late", PROMPT, 200)))
            )
            took_s = await wait_until(lambda: not engine.can_step, "NOT_SERVING", 10.0)
            assert TIMEOUT_S / 2 < took_s < TIMEOUT_S + MARGIN_S and engine.is_hung
            ended = {rid: await asyncio.wait_for(t, MARGIN_S) for rid, t in tasks.items()}
            reference = generate(tiny, PROMPT, 200)
            for rid, (tokens, error) in ended.items():
                assert isinstance(error, StepHung), (rid, error)
                assert "engine step hung for" in error.message
                assert to_grpc_status(error)[0] is grpc.StatusCode.UNAVAILABLE
                assert tokens == [] or rid != "late"
                got = (first if rid == "a" else []) + tokens
                assert got == reference[: len(got)]  # nothing twice, nothing out of order
            assert engine.num_hung_steps == 1
            [verdict] = [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL]
            assert "engine step hung" in verdict and "a batch of 2 requests ['a', 'b']" in verdict

            with pytest.raises(StepHung):  # new work is refused at once, nothing waits
                await asyncio.wait_for(
                    anext(engine.generate(greedy_request("new", PROMPT, 2))), 0.5
                )
            with pytest.raises(StepHung):  # a cleanup is told at once (it runs if the step returns)
                await asyncio.wait_for(engine.abort("a"), 0.5)

            steps_before = core.num_steps
            runner.release.set()  # the step returns after all: dropped; a probe brings it back
            await wait_until(lambda: engine.can_step, "SERVING again", 10.0)
            assert not engine.is_hung and engine.num_step_failures == 1
            assert core.num_steps - steps_before == 2  # the hung step and the probe: no "late"
            assert engine.load().num_running == engine.load().num_waiting == 0
            assert await collect(engine.generate(greedy_request("after", PROMPT, 4))) == (
                generate(tiny, PROMPT, 4), None,
            )  # fmt: skip
        finally:
            runner.release.set()
            await engine.stop()
        assert not any(t.name == "engine-loop" for t in threading.enumerate())
        assert_no_leaks(core)

    run(main())


def test_stopping_during_a_hang_waits_only_for_the_thread_and_frees_everything(tiny) -> None:
    """A worker shut down while its step hangs: stop() is not stuck behind the step (its
    abort-all is told StepHung), and once the step returns the thread exits leak-free."""

    async def main() -> None:
        core, runner = held_core(tiny)
        engine = AsyncEngine(core, step_timeout_s=TIMEOUT_S / 2)
        engine.start()
        try:
            stream = engine.generate(greedy_request("a", PROMPT, 200))
            await anext(stream)
            ending = asyncio.ensure_future(collect(stream))
            await runner.hold_next()
            await wait_until(lambda: engine.num_hung_steps == 1, "the verdict", 5.0)
            stopping = asyncio.ensure_future(engine.stop())
            await asyncio.sleep(0.2)
            assert not stopping.done()  # joining the engine thread, still in the step
            runner.release.set()
            await asyncio.wait_for(stopping, 5.0)
            assert isinstance((await ending)[1], StepHung)
            assert not any(t.name == "engine-loop" for t in threading.enumerate())
        finally:
            runner.release.set()
            await engine.stop()
        assert_no_leaks(core)

    run(main())


def test_a_worker_whose_step_hangs_says_not_serving_and_ends_its_streams_unavailable() -> None:
    """Through the real decode service and gRPC: the stream ends UNAVAILABLE, health turns
    NOT_SERVING and Info says draining (the router stops routing here); a new Decode is refused
    UNAVAILABLE at once; released, the worker probes its way back to SERVING, leak-free."""
    config = load_config({"model.path": "tiny", "model.device": "cpu", "cache.num_blocks": 16,
                          "cache.block_size": 128, "scheduler.step_timeout_s": TIMEOUT_S})  # fmt: skip
    runtime = build_worker_runtime(config, with_transport=False)
    runner = HeldRunner(runtime.engine.core.runner)
    runtime.engine.core.runner = runner
    engine, name = runtime.engine, DecodeService.SERVICE_NAME

    async def main() -> None:
        server, health_servicer = make_server(config, (name,))
        service = DecodeService(runtime, WorkerIdentity("d0", "127.0.0.1:0", WorkerRole.DECODE))
        service.add_to_server(server)
        port = bind_port(server, config, "127.0.0.1", 0)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub, health_stub = (
            worker_pb2_grpc.DecodeWorkerStub(channel),
            health_pb2_grpc.HealthStub(channel),
        )

        def decode(rid: str, n: int):
            greedy = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
            request = DecodeRequest(GenerateRequest(rid, tuple(PROMPT), greedy))
            return stub.Decode(wire.decode_request_to_proto(request))

        def hung_and_failed() -> tuple[float | None, float | None]:
            """The worker's /metrics series (what an operator alerts on)."""
            sample = service.registry.get_sample_value
            return sample("dsv4_engine_hung_steps_total"), sample("dsv4_engine_step_failures_total")

        async def serving() -> bool:
            await asyncio.sleep(0.05)  # a few rounds of the health follower
            reply = await health_stub.Check(health_pb2.HealthCheckRequest(service=name))
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        engine.start()
        await server.start()
        await set_serving(health_servicer, (name,), True)
        following = asyncio.create_task(
            follow_engine_health(health_servicer, (name,), lambda: engine.can_step, 0.01)
        )
        try:
            call = decode("a", 200)
            assert (await call.read()).token_ids
            await runner.hold_next()
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                for _ in range(1000):
                    assert await call.read() is not grpc.aio.EOF
            assert ended.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "engine step hung for" in ended.value.details()
            assert not await serving()
            assert (await stub.Info(worker_pb2.InfoRequest())).is_draining
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await asyncio.wait_for(decode("b", 2).read(), 1.0)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            assert hung_and_failed() == (1.0, 0.0)  # declared hung; the step has not returned

            runner.release.set()  # the step returns; the idle engine's probe brings it back
            await wait_until(lambda: engine.can_step, "SERVING again", 10.0)
            assert await serving()
            assert hung_and_failed() == (1.0, 1.0)  # it returned: its requests had failed
            info = await stub.Info(worker_pb2.InfoRequest())
            assert not info.is_draining and info.num_running_requests == 0
            assert info.num_free_blocks == info.num_total_blocks
        finally:
            runner.release.set()
            following.cancel()
            await channel.close()
            await server.stop(None)
            await service.stop()
            await engine.stop()
        assert not any(t.name == "engine-loop" for t in threading.enumerate())
        assert_no_leaks(engine.core)

    run(main())
