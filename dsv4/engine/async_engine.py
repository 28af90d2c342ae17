"""`AsyncEngine`: one `EngineCore` on its own thread, bridged to asyncio for the gRPC services.

The engine thread owns the core: every mutation (add, abort, adopt, release) is a command that
runs there between steps, so the core needs no locks. Results travel back through
`loop.call_soon_threadsafe` into one `asyncio.Queue` per request. A step that raises fails the
requests it touched with `StepFailed` (INTERNAL, logged once) and the loop goes on with the rest.
`can_step` turns False when the thread died or `MAX_CONSECUTIVE_STEP_FAILURES` steps in a row
raised (the worker's health then says NOT_SERVING); while so, an idle engine tries a one-token
probe request every `PROBE_INTERVAL_S`, and any step that succeeds makes it True again.

Who calls what: servicers (asyncio thread) call the async methods; nothing else touches the core.
`stop()` aborts every live request, ends the thread and joins it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from dsv4.engine.core import EngineCore, EngineLoad, HeldBlocks
from dsv4.errors import Cancelled, Dsv4Error, StepFailed, Unavailable
from dsv4.scheduler.batch import RequestOutput
from dsv4.scheduler.request import FinishCause, Request

log = logging.getLogger(__name__)
T = TypeVar("T")
_IDLE_WAIT_S = 0.05
MAX_CONSECUTIVE_STEP_FAILURES = 3
PROBE_INTERVAL_S = 1.0
PROBE_REQUEST_ID = "__step_probe__"


@dataclass(frozen=True)
class PrefillOutcome:
    """What a prefill-only request produced: the first token and, unless the request already
    finished with it, the blocks held for the decode worker's pull."""

    first_token: int
    finish_reason: FinishCause | None
    held: HeldBlocks | None


class _Stream:
    """Per-request delivery from the engine thread to one asyncio consumer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def push(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, core: EngineCore, name: str = "engine") -> None:
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
        self._pending: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = set()

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        if self.is_running:  # a thread that died has failed its streams already
            await self.call(self._abort_all)
        self._stopping.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
        self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._has_died

    @property
    def can_step(self) -> bool:
        """False when the engine thread is gone or its last steps all raised (read anywhere)."""
        return self.is_running and self.consecutive_step_failures < MAX_CONSECUTIVE_STEP_FAILURES

    def load(self) -> EngineLoad:
        """The load as of the last step (read from any thread)."""
        return self._load

    # ---- commands ------------------------------------------------------------------------
    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between steps; its result or exception comes back."""
        if not self.is_running:
            raise Unavailable(f"{self.name} is not running")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as exc:  # delivered to the awaiting caller
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        pending = (loop, future)
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
            await self.call(lambda: self.core.add_request(request))
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
            await self.call(lambda: self.core.add_request(request, prefill_only=True))
        except BaseException:
            self._streams.pop(rid, None)
            raise
        first: RequestOutput | None = None
        async for out in self._drain(rid, stream):
            first = out
        assert first is not None and first.new_token_ids
        held = await self.call(lambda: self.core.held.get(rid))
        return PrefillOutcome(first.new_token_ids[0], first.finish_reason, held)

    async def adopt(self, request: Request) -> tuple[int, ...]:
        """Decode side: blocks for the pulled prompt (hand-off order)."""
        return await self.call(lambda: self.core.adopt(request))

    async def activate(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Decode side, after the pull landed: stream the request's tokens."""
        stream = self._open(request_id)
        try:
            await self.call(lambda: self.core.activate(request_id))
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
            for loop, future in list(self._pending):
                loop.call_soon_threadsafe(_set_exception, future, ended)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            # Commands run with no step in flight (async scheduling launches one ahead): an
            # adopted request's pull then writes blocks that no launched step still writes.
            if self.core.has_step_in_flight and not self._commands.empty():
                self._step(self.core.drain)
            if not self.core.has_step_in_flight:
                self._run_commands(block=not self.core.has_work())
            if not self.core.has_work():
                self._maybe_probe()
                continue
            self._step(self.core.step)
        self.core.abort(PROBE_REQUEST_ID)  # one may have started after stop()'s abort-all

    def _step(self, step: Callable[[], list[RequestOutput]]) -> None:
        """Run one core step (or drain) and deliver its outputs; failures end its requests."""
        try:
            outputs = step()
        except StepFailed as exc:  # the core already ended the step's requests
            self._on_step_failure(exc)
            for request_id in exc.request_ids:
                self._fail(request_id, exc)
            return
        except Exception as exc:  # schedule() itself raised: nothing can be trusted
            failure = StepFailed(f"{self.name}: engine step failed: {exc!r}")
            failure.__cause__ = exc
            self._on_step_failure(failure)
            self.core.discard_in_flight()
            self._abort_all(failure)
            return
        self.consecutive_step_failures = 0
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.push(out)
        self._load = self.core.load()

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

    def _abort_all(self, exc: BaseException | None = None) -> None:
        for request_id in list(self.core.scheduler.request_ids()):
            self.core.abort(request_id)
        for request_id in list(self._streams):
            self._fail(request_id, exc or Unavailable(f"{self.name} is shutting down"))


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
