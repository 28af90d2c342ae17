"""`AsyncEngine`: one `EngineCore` on its own thread, bridged to asyncio for the gRPC services.

The engine thread owns the core: every mutation (add, abort, adopt, release) is a command that
runs there between steps, so the core needs no locks. Results travel back through
`loop.call_soon_threadsafe` into one `asyncio.Queue` per request. A step that raises fails the
requests it touched with `StepFailed` (INTERNAL, logged once) and the loop goes on with the rest.
`can_step` turns False when the thread died or `MAX_CONSECUTIVE_STEP_FAILURES` steps in a row
raised (the worker's health then says NOT_SERVING); while so, an idle engine tries a one-token
probe request every `PROBE_INTERVAL_S`, and any step that succeeds makes it True again.

A step that never returns (a kernel or collective that hangs, a deadlock) is caught by the step
watchdog, an asyncio task of this engine (`StepWatch`; `step_timeout_s`, 0: none): once the step
in progress has run past the timeout, `is_hung` and so `can_step` turn False, every live stream
and every waiting `call` ends with `StepHung` (UNAVAILABLE), new work is refused and a CRITICAL
line names the step's requests. If the step returns after all, its outputs are dropped, the
requests ended for it are aborted (blocks freed) and the engine counts as unable to step, as
after repeated failures: health comes back with the next step that succeeds (the idle probe).

Who calls what: servicers (asyncio thread, one event loop) call the async methods; nothing else
touches the core. `stop()` aborts every live request, ends the thread and joins it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from dsv4.engine.core import EngineCore, EngineLoad, HeldBlocks
from dsv4.engine.step_watch import HungStep, StepWatch
from dsv4.errors import Cancelled, Dsv4Error, StepFailed, StepHung, Unavailable
from dsv4.scheduler.batch import RequestOutput
from dsv4.scheduler.request import FinishCause, Request
from dsv4.types import PromptLogprobs, TokenLogprobs

log = logging.getLogger(__name__)
T = TypeVar("T")
_IDLE_WAIT_S = 0.05
MAX_CONSECUTIVE_STEP_FAILURES = 3
PROBE_INTERVAL_S = 1.0
PROBE_REQUEST_ID = "__step_probe__"
WATCH_INTERVAL_S = 1.0  # the watchdog looks at least this often (a quarter timeout if shorter)
STOP_JOIN_S = 10.0


@dataclass(frozen=True)
class PrefillOutcome:
    """What a prefill-only request produced: the first token and, unless the request already
    finished with it, the blocks held for the decode worker's pull."""

    first_token: int
    finish_reason: FinishCause | None
    held: HeldBlocks | None
    first_token_logprobs: TokenLogprobs | None = None  # when the request asked for logprobs
    prompt_logprobs: PromptLogprobs | None = None  # when it asked for prompt_logprobs


class _Stream:
    """Per-request delivery from the engine thread to one asyncio consumer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def push(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass(eq=False)
class _Call:
    """A `call` waiting for its command. `dropped` (set by the watchdog under the watch lock,
    before a hung step can return): the command adds work for a caller already told the step
    hung, so it must not run."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    adds_work: bool
    dropped: bool = False


class AsyncEngine:
    def __init__(self, core: EngineCore, name: str = "engine", step_timeout_s: float = 0.0) -> None:
        """`step_timeout_s`: a step running longer is declared hung (0: no watchdog); the
        worker passes `scheduler.step_timeout_s`."""
        self.core = core
        self.name = name
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._load = core.load()
        self.num_step_failures = 0
        self.consecutive_step_failures = 0  # written by the engine thread only
        self._last_probe_s = 0.0
        self._has_died = False
        # `call`s awaiting their command (added and removed on the asyncio side)
        self._pending: set[_Call] = set()
        self._watch = StepWatch(step_timeout_s)
        self._watchdog: asyncio.Task[None] | None = None
        self.num_hung_steps = 0  # declared by the watchdog
        self._ended_by_hang: tuple[str, ...] = ()  # engine thread: abort once no step flies

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread and, with a step timeout, the watchdog: call it on the event
        loop that serves this engine (the watchdog is a task there)."""
        loop = asyncio.get_running_loop() if self._watch.timeout_s > 0 else None
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-loop", daemon=True)
        self._thread.start()
        if loop is not None:
            self._watchdog = loop.create_task(self._watch_steps(), name=f"{self.name}-watchdog")

    async def stop(self) -> None:
        if self._thread is None:
            return
        if self.is_running:  # a thread that died has failed its streams already
            with contextlib.suppress(StepHung):  # so has a hung step (aborted if it returns)
                await self.call(self._abort_all)
        self._stopping.set()
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
            self._watchdog = None
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, STOP_JOIN_S)
        if self._thread.is_alive():
            log.error("%s: the engine thread is still in a hung step after %g s; left behind",
                      self.name, STOP_JOIN_S)  # fmt: skip
        self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._has_died

    @property
    def is_hung(self) -> bool:
        """The step in progress has run past the step timeout (read anywhere)."""
        return self._watch.is_hung

    @property
    def can_step(self) -> bool:
        """False when the engine thread is gone, a step hangs, or the last steps all raised
        (read anywhere)."""
        return (
            self.is_running
            and not self.is_hung
            and self.consecutive_step_failures < MAX_CONSECUTIVE_STEP_FAILURES
        )

    def load(self) -> EngineLoad:
        """The load as of the last step or command, taken before any stream or caller hears
        of it (read from any thread)."""
        return self._load

    # ---- commands ------------------------------------------------------------------------
    async def call(self, fn: Callable[[], T], *, adds_work: bool = False) -> T:
        """Run `fn` on the engine thread between steps; its result or exception comes back.
        Nobody waits on a hung step: `StepHung` comes back at once; work that `adds_work` (a
        request, an adoption) is refused, anything else (abort, release) still runs if the
        step returns."""
        if not self.is_running:
            raise Unavailable(f"{self.name} is not running")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        pending = _Call(loop, future, adds_work)

        def run() -> None:
            if pending.dropped:
                return
            try:
                result = fn()
            except BaseException as exc:  # delivered to the awaiting caller
                self._load = self.core.load()
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                self._load = self.core.load()  # the caller may read the load once it hears
                loop.call_soon_threadsafe(_set_result, future, result)

        if self.is_hung:
            future.cancel()  # nobody awaits it: a late result goes nowhere
            if not adds_work:
                self._commands.put(run)
            raise self._hung_error(self._watch.elapsed_s())
        self._pending.add(pending)
        try:
            self._commands.put(run)
            return await future
        finally:
            self._pending.discard(pending)

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Run a whole request; yields its outputs until the finishing one."""
        stream = self._open(request.request_id)
        try:
            await self.call(lambda: self.core.add_request(request), adds_work=True)
        except BaseException:
            self._streams.pop(request.request_id, None)
            raise
        async for out in self._drain(request.request_id, stream):
            yield out

    async def prefill(self, request: Request) -> PrefillOutcome:
        """Prefill only; the blocks stay held for a pull unless the first token ended it."""
        rid = request.request_id
        stream = self._open(rid)
        try:
            await self.call(
                lambda: self.core.add_request(request, prefill_only=True), adds_work=True
            )
        except BaseException:
            self._streams.pop(rid, None)
            raise
        first: RequestOutput | None = None
        async for out in self._drain(rid, stream):
            first = out
        assert first is not None and first.new_token_ids
        held = await self.call(lambda: self.core.held.get(rid))
        logprobs = first.logprobs[0] if first.logprobs else None
        return PrefillOutcome(first.new_token_ids[0], first.finish_reason, held, logprobs,
                              first.prompt_logprobs)  # fmt: skip

    async def adopt(self, request: Request) -> tuple[int, ...]:
        """Decode side: blocks for the pulled prompt (hand-off order)."""
        return await self.call(lambda: self.core.adopt(request), adds_work=True)

    async def activate(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Decode side, after the pull landed: stream the request's tokens."""
        stream = self._open(request_id)
        try:
            await self.call(lambda: self.core.activate(request_id), adds_work=True)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        async for out in self._drain(request_id, stream):
            yield out

    async def abandon(self, request_id: str) -> None:
        await self.call(lambda: self.core.abandon(request_id))

    async def abort(self, request_id: str) -> bool:
        def run() -> bool:
            found = self.core.abort(request_id)
            self._fail(request_id, Cancelled(f"request {request_id!r} was aborted"))
            return found

        return await self.call(run)

    async def release_hold(self, request_id: str) -> bool:
        return await self.call(lambda: self.core.release_hold(request_id))

    # ---- delivery --------------------------------------------------------------------------
    def _open(self, request_id: str) -> _Stream:
        if request_id in self._streams:
            raise Dsv4Error(f"request id {request_id!r} is already streaming")
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        return stream

    async def _drain(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine side already ended the request
                    raise item
                finished = item.is_finished
                yield item
                if finished:
                    return
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished and self.is_running:  # the consumer left early: stop the work
                self._commands.put(lambda: self.core.abort(request_id))

    def _fail(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.push(exc)

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        ended = Unavailable(f"{self.name} stopped")
        try:
            self._loop()
        except BaseException as exc:  # a bug outside any step: no stream may wait forever
            self._has_died = True
            log.critical("%s: the engine thread died", self.name, exc_info=exc)
            ended = Unavailable(f"{self.name}: the engine thread died: {exc!r}")
            for request_id in list(self._streams):
                self._fail(request_id, ended)
        finally:  # commands queued too late never run: their callers hear so
            for pending in list(self._pending):
                pending.loop.call_soon_threadsafe(_set_exception, pending.future, ended)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            # Commands run with no step in flight (async scheduling launches one ahead): an
            # adopted request's pull then writes blocks that no launched step still writes.
            if self.core.has_step_in_flight and (self._ended_by_hang or not self._commands.empty()):
                self._step(self.core.drain)
            if not self.core.has_step_in_flight:
                self._abort_ended_by_hang()
                self._run_commands(block=not self.core.has_work())
            if not self.core.has_work():
                self._maybe_probe()
                continue
            self._step(self.core.step)
        if self.core.has_step_in_flight and self._ended_by_hang:  # stopped right after a hang
            self._step(self.core.drain)
        self._abort_ended_by_hang()
        self.core.abort(PROBE_REQUEST_ID)  # one may have started after stop()'s abort-all

    def _step(self, step: Callable[[], list[RequestOutput]]) -> None:
        """Run one core step (or drain) under the watch and deliver its outputs; failures end
        its requests; a step declared hung delivers nothing (`_after_hang`)."""
        self.core.step_request_ids = ()
        started_s = time.monotonic()
        self._watch.begin()
        try:
            outputs = self._run_step(step)
        finally:
            hung = self._watch.end()
        if hung is not None:
            self._after_hang(hung, time.monotonic() - started_s)
            return
        if outputs is None:
            return
        self.consecutive_step_failures = 0
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.push(out)

    def _run_step(self, step: Callable[[], list[RequestOutput]]) -> list[RequestOutput] | None:
        """The step's outputs, or None when it raised (its requests then ended)."""
        try:
            outputs = step()
        except StepFailed as exc:  # the core already ended the step's requests
            self._load = self.core.load()
            self._on_step_failure(exc)
            for request_id in exc.request_ids:
                self._fail(request_id, exc)
        except Exception as exc:  # schedule() itself raised: nothing can be trusted
            failure = StepFailed(f"{self.name}: engine step failed: {exc!r}")
            failure.__cause__ = exc
            self._on_step_failure(failure)
            self.core.discard_in_flight()
            self._abort_all(failure)
        else:
            self._load = self.core.load()  # before any stream hears of the step
            return outputs
        return None

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else None
        except queue.Empty:
            return
        while True:
            if command is not None:
                command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self._load = self.core.load()

    def _on_step_failure(self, exc: StepFailed) -> None:
        self.num_step_failures += 1
        self.consecutive_step_failures += 1
        log.error("%s: %s", self.name, exc.message, exc_info=exc.__cause__ or exc)

    def _maybe_probe(self) -> None:
        """An idle engine that cannot step checks whether it can again (one token)."""
        if (
            self.consecutive_step_failures < MAX_CONSECUTIVE_STEP_FAILURES
            or self._stopping.is_set()
        ):
            return
        now = time.monotonic()
        if now - self._last_probe_s < PROBE_INTERVAL_S:
            return
        self._last_probe_s = now
        self.core.add_request(Request(PROBE_REQUEST_ID, (2, 3, 4, 5), max_new_tokens=1))

    # ---- the step watchdog ------------------------------------------------------------------
    async def _watch_steps(self) -> None:
        """Owned by this engine (`stop` cancels it): asks for a verdict on the step in progress
        every quarter timeout, at most `WATCH_INTERVAL_S` apart (found hung within the timeout
        plus that)."""
        interval_s = min(WATCH_INTERVAL_S, self._watch.timeout_s / 4)
        while True:
            await asyncio.sleep(interval_s)
            try:
                self._watch.declare(self._condemn)
            except Exception:  # a bug here must not end the watch
                log.exception("%s: the step watchdog failed; watching on", self.name)

    def _condemn(self, elapsed_s: float) -> HungStep:
        """The verdict on a hung step (asyncio thread, under the watch lock): every live stream
        and every waiting call ends with `StepHung` now; calls that add work are dropped; the
        engine thread aborts the ended requests if the step returns (`_after_hang`)."""
        self.num_hung_steps += 1
        step_ids, live = self.core.step_request_ids, tuple(self._streams)
        error = self._hung_error(elapsed_s)
        log.critical(
            "%s: engine step hung for %.1f s (scheduler.step_timeout_s %g): a batch of %d "
            "requests %s; ending %d live streams and %d waiting calls (UNAVAILABLE); health "
            "NOT_SERVING", self.name, elapsed_s, self._watch.timeout_s, len(step_ids),
            list(step_ids[:16]), len(live), len(self._pending),
        )  # fmt: skip
        for request_id in live:
            self._fail(request_id, error)
        for pending in self._pending:
            pending.dropped = pending.adds_work
            pending.loop.call_soon_threadsafe(_set_exception, pending.future, error)
        return HungStep(elapsed_s, step_ids, tuple(dict.fromkeys(step_ids + live)))

    def _hung_error(self, elapsed_s: float) -> StepHung:
        return StepHung(
            f"{self.name}: engine step hung for {elapsed_s:.0f} s (scheduler.step_timeout_s "
            f"{self._watch.timeout_s:g}): this worker stopped serving; retry on another"
        )

    def _after_hang(self, hung: HungStep, took_s: float) -> None:
        """A step declared hung returned after all (engine thread): its outputs are dropped
        (the streams ended already), the requests ended for it are aborted once no step is in
        flight, and health stays NOT_SERVING until a step succeeds (the idle probe): a step that
        took this long proves nothing about the next one."""
        self.num_step_failures += 1
        self.consecutive_step_failures = MAX_CONSECUTIVE_STEP_FAILURES
        self._ended_by_hang += hung.ended_request_ids
        log.warning(
            "%s: the step declared hung returned after %.1f s; dropped its outputs, ending %d "
            "requests; NOT_SERVING until a step succeeds",
            self.name, took_s, len(hung.ended_request_ids),
        )  # fmt: skip

    def _abort_ended_by_hang(self) -> None:
        ended, self._ended_by_hang = self._ended_by_hang, ()
        for request_id in ended:
            self.core.abort(request_id)
        if ended:
            self._load = self.core.load()

    def _abort_all(self, exc: BaseException | None = None) -> None:
        for request_id in list(self.core.scheduler.request_ids()):
            self.core.abort(request_id)
        self._load = self.core.load()
        for request_id in list(self._streams):
            self._fail(request_id, exc or Unavailable(f"{self.name} is shutting down"))


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
