"""One Router.Generate request, from route choice to the last streamed chunk.

Flow: the prefill leg (prefill_leg.py: choose (P, D), P.Prefill, retries on another P) ->
stream the first token at once (TTFT) -> D.Decode(request, first token, handle, pull policy),
relaying D's stream through `OutputTracker` (text, stop strings, limits). A D that fails before
its first message (UNAVAILABLE-like, or RESOURCE_EXHAUSTED) is replaced by another compatible D
with the same handle, at most `max_prefill_retries` times; when every D refused as full, the
full ones are tried again while P's lease, the deadline and `decode_full_wait_s` allow
(decode_room.py). A D that dies mid-stream (error,
stream closed without a last message, or marked down by the pool's probes) ends the request
with UNAVAILABLE at once, or, with `migrate_on_decode_failure`, re-prefills prompt + tokens so
far on another pair (request id `<id>.m<n>`, at most `max_migrations` times) and continues the
stream. Without a prefill pool, a colocated worker gets Decode with no handle. The request's own
fault (not in `clients.RETRIABLE_CODES`) ends it at once: never retried, never migrated.

Cleanup is owned here: whenever a request ends other than by D's own last message (client
cancel, Router.Abort, error, router-side stop), the live call is cancelled, D gets an Abort and
P's lease a Release, sent as background tasks of the shared `TaskOwner` (idempotent on the
workers). Runs on the router's event loop; `abort` and `fail_worker` may be called any time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing

import grpc

from dsv4.errors import ResourceExhausted, Unavailable, without_retry_hint
from dsv4.types import (
    DecodeRequest,
    FinishReason,
    GenerateRequest,
    PrefillResult,
    StreamChunk,
    WorkerRole,
)
from router_svc.accounting import RequestAccount
from router_svc.choice import choose_colocated, choose_decode, explain_no_route
from router_svc.clients import CallInterrupted, WorkerCallError
from router_svc.deadline import Deadline
from router_svc.decode_room import RETRY_INTERVAL_S, DecodeRoomWait
from router_svc.flow_settings import FlowDeps
from router_svc.live import ActiveCall, RequestAborted
from router_svc.output import OutputStep, OutputTracker
from router_svc.prefill_leg import Exclusions, run_prefill_leg
from router_svc.view import WorkerView

logger = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 128


class _StreamClosedEarly(Exception):
    """D ended its stream with OK but without a last message (finish_reason)."""


class _DecodeLost(Exception):
    def __init__(self, address: str, reason: str, has_streamed: bool) -> None:
        super().__init__(f"decode worker {address} failed: {reason}")
        self.address, self.reason, self.has_streamed = address, reason, has_streamed


def derived_request_id(request_id: str, suffix: str) -> str:
    """`<id>.<suffix>`, trimmed to the 128-character limit (for migrated attempts)."""
    return f"{request_id[: MAX_REQUEST_ID_CHARS - len(suffix) - 1]}.{suffix}"


class RequestFlow:
    """Created by the servicer per Generate call; iterate `run()` exactly once."""

    def __init__(
        self, request: GenerateRequest, deadline: Deadline, deps: FlowDeps, received_at_s: float
    ) -> None:
        self.request_id = request.request_id
        self._request, self._deadline, self._deps = request, deadline, deps
        self._settings = deps.settings
        self._tracker = OutputTracker(
            request.sampling,
            codec=deps.text.codec,
            eos_token_id=deps.text.eos_token_id,
            prompt_token_ids=request.prompt_token_ids,
        )
        self._account = RequestAccount(request.num_prompt_tokens, self._tracker, received_at_s)
        self._active = ActiveCall()
        self._lease: tuple[str, PrefillResult, str] | None = None  # (P address, result, rid)
        self._decoding_on: tuple[str, str] | None = None  # (D address, request id D knows)
        self._excluded = Exclusions()

    # ---- control (any time, event loop) --------------------------------------------------------

    def abort(self) -> None:
        """Router.Abort: end the stream with FINISH_REASON_ABORT as soon as possible."""
        self._active.abort()

    def fail_worker(self, address: str, reason: str) -> None:
        """The pool marked `address` down: give up the call on it (retry or fail over)."""
        self._active.fail_worker(address, reason)

    # ---- the stream ---------------------------------------------------------------------------

    async def run(self) -> AsyncIterator[StreamChunk]:
        try:
            async with aclosing(self._run()) as chunks:
                async for chunk in chunks:
                    yield chunk
        except RequestAborted:
            yield self._account.chunk(OutputStep((), ""), FinishReason.ABORT)
        finally:
            self._clean_up()

    async def _run(self) -> AsyncIterator[StreamChunk]:
        request = self._request
        for num_migrations in range(self._settings.max_migrations + 1):
            prefill_view, prefill = await run_prefill_leg(
                request,
                deps=self._deps,
                deadline=self._deadline,
                active=self._active,
                excluded=self._excluded,
                account=self._account,
            )
            if prefill is not None:
                self._lease = (prefill_view.address, prefill, request.request_id)
                first = prefill.first_token_logprobs  # P's, when the request asked
                step = self._tracker.add(
                    (prefill.first_token_id,), prefill.first_token_text,
                    () if first is None else (first,), prefill.prompt_logprobs,
                )  # fmt: skip
                yield self._account.chunk(step, step.finish_reason)
                if step.finish_reason is not None:
                    return  # the first token ended it: D is never called, the lease is released
            try:
                async with aclosing(self._decode_leg(request, prefill_view, prefill)) as chunks:
                    async for chunk in chunks:
                        yield chunk
                return
            except _DecodeLost as lost:
                may_migrate = self._settings.migrate_on_decode_failure and lost.has_streamed
                if not may_migrate or num_migrations == self._settings.max_migrations:
                    raise Unavailable(
                        f"{lost} after {self._tracker.num_tokens} tokens; the request cannot "
                        "continue (enable router.migrate_on_decode_failure to resume elsewhere)"
                    ) from lost
                self._clean_up()  # abort the lost D, release its lease
                self._excluded.decode.add(lost.address)
                request = self._continuation(num_migrations + 1)
                self._deps.metrics.migrations.inc()
                logger.warning("%s: migrating as %s", lost, request.request_id)

    def _continuation(self, num_migrations: int) -> GenerateRequest:
        """Prompt + tokens so far, for the remaining budget, as a fresh request id (the
        prompt's logprobs went out with the first token: not asked again)."""
        original = self._request
        sampling = dataclasses.replace(
            original.sampling, max_new_tokens=self._tracker.num_tokens_left, prompt_logprobs=None
        )
        return dataclasses.replace(
            original,
            request_id=derived_request_id(original.request_id, f"m{num_migrations}"),
            prompt_token_ids=original.prompt_token_ids + tuple(self._tracker.token_ids),
            sampling=sampling,
        )

    # ---- decode leg ---------------------------------------------------------------------------

    def _pick_decode(self, prefill_view: WorkerView, prefill: PrefillResult | None) -> WorkerView:
        snapshot = self._deps.pool.snapshot()
        if prefill is None:
            choice = choose_colocated(
                snapshot.with_role(WorkerRole.COLOCATED), self._excluded.decode
            )
        else:
            decodes = snapshot.with_role(WorkerRole.DECODE)
            choice = choose_decode(decodes, prefill.handle.layout_hash, self._excluded.decode)
        if choice is None:
            raise Unavailable(
                explain_no_route(snapshot, self._excluded.prefill, self._excluded.decode)
            )
        return choice

    async def _decode_leg(
        self, request: GenerateRequest, prefill_view: WorkerView, prefill: PrefillResult | None
    ) -> AsyncIterator[StreamChunk]:
        decode_request = DecodeRequest(
            request=request,
            first_token_id=prefill.first_token_id if prefill else None,
            handle=prefill.handle if prefill else None,
            pull_failure_policy=self._settings.pull_failure_policy,
        )
        num_attempts, num_replacements, full_reason, full = 0, 0, "", set[str]()
        room_wait: DecodeRoomWait | None = None
        while True:
            self._active.check_aborted()
            # a colocated request's first call goes to the worker its prefill leg chose
            decode = prefill_view if prefill is None and num_attempts == 0 else None
            try:
                decode = decode or self._pick_decode(prefill_view, prefill)
            except Unavailable as exc:
                if not full_reason:
                    raise
                # the D's left were full: load, not an outage; wait for room while it pays
                room_wait = room_wait or self._room_wait(prefill)
                if not room_wait.may_retry(time.monotonic()):
                    raise _all_full(full_reason) from exc
                await asyncio.sleep(RETRY_INTERVAL_S)
                self._excluded.decode -= full
                full.clear()
                self._deps.metrics.decode_full_retries.inc()
                continue
            has_streamed, is_full = False, False
            num_attempts += 1
            try:
                async with aclosing(self._relay(decode, decode_request)) as chunks:
                    async for chunk in chunks:
                        has_streamed = True
                        yield chunk
                return
            except WorkerCallError as exc:
                if exc.code is grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise self._deadline.exceeded() from exc
                is_full = exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED and not has_streamed
                if not exc.is_unreachable and not is_full:  # the request's own fault: no retry
                    raise exc.to_dsv4_error() from exc
                if not is_full:
                    self._deps.pool.report_suspect(decode.address)
                reason = f"{exc.code.name}: {exc.details}"
                # D's own retry hint is not the client's: the router gives its own
                full_reason = without_retry_hint(reason) if is_full else full_reason
            except CallInterrupted as exc:
                self._active.check_aborted()
                reason = exc.reason
            except _StreamClosedEarly:
                reason = "it closed its stream before the last message"
            lost = _DecodeLost(decode.address, reason, has_streamed)
            if not is_full:
                self._deps.metrics.decode_failures.inc()
            if has_streamed:
                raise lost
            self._abort_decode()  # D may hold the request although it never answered
            self._excluded.decode.add(decode.address)
            if is_full:  # tried again once no D is left (`_room_wait`): not a replacement
                full.add(decode.address)
                continue
            num_replacements += 1
            if num_replacements > self._settings.max_prefill_retries:
                raise lost

    def _room_wait(self, prefill: PrefillResult | None) -> DecodeRoomWait:
        return DecodeRoomWait.start(
            wait_s=self._settings.decode_full_wait_s,
            deadline=self._deadline,
            handle=prefill.handle if prefill else None,
            pull_timeout_s=self._settings.pull_timeout_s,
            now_s=time.monotonic(),
            now_unix_s=time.time(),
        )

    async def _relay(
        self, decode: WorkerView, decode_request: DecodeRequest
    ) -> AsyncIterator[StreamChunk]:
        """Relay one Decode stream; raises _DecodeLost when it ends without a last message."""
        request = decode_request.request
        timeout_s = self._deadline.call_timeout_s(time.monotonic())
        self._deps.pool.note_dispatch(decode.address, request)
        call = self._deps.clients.start_decode(decode.address, decode_request, timeout_s)
        self._active.call = call
        self._decoding_on = (decode.address, request.request_id)
        self._account.on_decode_started(decode.worker_id)
        is_done = False
        try:
            while (chunk := await call.read()) is not None:
                step = self._tracker.add(
                    chunk.token_ids, chunk.text, chunk.logprobs, chunk.prompt_logprobs
                )
                if chunk.is_last:
                    is_done = True
                    self._decoding_on, self._lease = None, None  # D finished: it owned the lease
                    self._account.on_decode_finished(chunk.usage)
                    yield self._account.chunk(step, step.finish_reason or chunk.finish_reason)
                    return
                if step.finish_reason is not None:  # the router stops it; cleanup aborts D
                    yield self._account.chunk(step, step.finish_reason)
                    return
                if step.token_ids or step.text:
                    yield self._account.chunk(step)
                self._active.check_aborted()
            is_done = True
        finally:
            self._active.call = None
            if not is_done:
                call.interrupt("the router stopped reading this stream")
        raise _StreamClosedEarly()

    # ---- cleanup ---------------------------------------------------------------------------

    def _abort_decode(self) -> None:
        if self._decoding_on is not None:
            address, request_id = self._decoding_on
            self._decoding_on = None
            clients, timeout_s = self._deps.clients, self._settings.control_timeout_s
            self._deps.cleanup.spawn(
                _quietly(clients.abort_decode(address, request_id, timeout_s)),
                f"Abort {request_id} on {address}",
            )

    def _clean_up(self) -> None:
        """Cancel the live call, Abort D, Release P's lease: whatever is still outstanding."""
        if self._active.call is not None:
            self._active.call.interrupt("the request ended")
            self._active.call = None
        self._abort_decode()
        if self._lease is not None:
            address, result, request_id = self._lease
            self._lease = None
            lease_id, timeout_s = result.handle.lease_id, self._settings.control_timeout_s
            self._deps.cleanup.spawn(
                _quietly(self._deps.clients.release(address, lease_id, request_id, timeout_s)),
                f"Release {lease_id} on {address}",
            )


def _all_full(reason: str) -> ResourceExhausted:
    return ResourceExhausted(
        f"no decode worker has room for this request (last: {reason}): retry later, or add "
        "decode capacity",
        retry_after_s=1.0,
    )


async def _quietly(call: Awaitable[bool]) -> None:
    """Best-effort cleanup call: a worker that is gone has nothing to free (its TTLs do)."""
    try:
        await call
    except WorkerCallError as exc:
        logger.debug("cleanup: %s (the worker's own timeouts free what it holds)", exc)
