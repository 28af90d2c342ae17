"""One Decode call on a decode worker, from the KV pull to the last streamed chunk.

Disaggregated (handle + first token): adopt blocks (waiting a bounded time for free ones, else
RESOURCE_EXHAUSTED, leaving P's lease to the router's retry on another D or to its TTL) ->
pull P's blocks into them (an owned task polling the transport; a cancelled call lets the
transfer finish before the blocks are freed) -> Release on P (best effort, background) ->
activate and stream. A failed pull, by policy: FAIL ends the call UNAVAILABLE; RECOMPUTE frees
the blocks and runs the whole request locally. The local run re-samples the first token: greedy
and seeded requests reproduce P's token (same prefill, same fresh generator), and the stream
goes on after it without re-sending it. An unseeded sampled request may draw another token; then
the local run is dropped and the request continues from prompt + P's first token instead, so the
stream stays consistent (tokens after it come from a different random stream than P would have
used: nothing promised more for unseeded sampling).
Colocated (neither): generate locally and stream every token.

Event-loop thread only. `Live` is the servicer's per-call record (Abort and Info read it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from decode_svc.prefill_client import PrefillClients
from decode_svc.text import TextDeltas
from dsv4.errors import (
    Cancelled,
    Dsv4Error,
    LayoutMismatch,
    OutOfBlocks,
    ResourceExhausted,
    Unavailable,
)
from dsv4.scheduler.batch import RequestOutput
from dsv4.serving.metrics import DecodeMetrics
from dsv4.serving.tasks import TaskOwner
from dsv4.transfer import ExportedBlocks, PullState, PullStatus, TransportEndpoint
from dsv4.types import (
    DecodeRequest,
    FinishReason,
    GenerateRequest,
    KVHandle,
    PullFailurePolicy,
    StreamChunk,
    Usage,
)
from dsv4.worker.build import WorkerRuntime

logger = logging.getLogger(__name__)

PULL_POLL_INTERVAL_S = 0.001
ADOPT_RETRY_INTERVAL_S = 0.02
ADOPT_WAIT_S = 0.5  # a full decode worker refuses within a second (the router tries another)


@dataclass
class Live:
    """A running Decode call. `engine_request_id` is what the engine knows it by."""

    request_id: str
    engine_request_id: str
    num_tokens_left: int
    is_streaming: bool = False  # the engine has produced output: Abort goes to the engine
    is_aborted: bool = False


@dataclass(frozen=True)
class DecodeDeps:
    runtime: WorkerRuntime
    worker_id: str
    tasks: TaskOwner
    prefill_clients: PrefillClients
    metrics: DecodeMetrics


class DecodeSession:
    def __init__(self, deps: DecodeDeps, decode: DecodeRequest, live: Live) -> None:
        self._deps = deps
        self._engine = deps.runtime.engine
        self._decode = decode
        self._request = decode.request
        self._live = live
        self._usage = Usage(
            prompt_tokens=decode.request.num_prompt_tokens, decode_worker_id=deps.worker_id
        )

    async def run(self) -> AsyncIterator[StreamChunk]:
        if self._decode.handle is None:
            outputs = self._engine.generate(self._deps.runtime.engine_request(self._request))
            async for chunk in self._relay(outputs, TextDeltas(self._deps.runtime.codec), 0):
                yield chunk
            return
        first = self._decode.first_token_id
        assert first is not None  # wire checks first token and handle come together
        async for chunk in self._disaggregated(self._decode.handle, first):
            yield chunk

    # ---- disaggregated ------------------------------------------------------------------------
    async def _disaggregated(self, handle: KVHandle, first: int) -> AsyncIterator[StreamChunk]:
        rid, runtime = self._request.request_id, self._deps.runtime
        finish = self._first_token_finish(first)
        if finish is not None:  # nothing to decode: P's token already ended the request
            self._release_on_prefill(handle)
            yield self._last(None, finish, 1)
            return
        if handle.layout_hash != runtime.layout.compat_hash:
            self._release_on_prefill(handle)
            raise LayoutMismatch(
                f"KV layout {handle.layout_hash[:12]} of {handle.prefill_worker_id} differs from "
                f"this decode worker's {runtime.layout.compat_hash[:12]}: pair workers of one layout"
            )
        engine_request = runtime.engine_request(self._request)
        engine_request.output_token_ids.append(first)
        dst_block_ids = await self._adopt(engine_request, handle)
        if dst_block_ids is None:  # aborted while it waited for blocks
            yield self._last(None, FinishReason.ABORT, 1)
            return
        state = await self._pull_guarded(handle, dst_block_ids)
        try:
            self._release_on_prefill(handle)
            metrics = self._deps.metrics
            if state.status is PullStatus.DONE:
                assert state.stats is not None
                metrics.transfer_bytes.inc(state.stats.num_bytes)
                metrics.pull_time.observe(state.stats.seconds)
                self._usage = dataclasses.replace(
                    self._usage,
                    kv_transfer_bytes=state.stats.num_bytes,
                    kv_transfer_ms=state.stats.seconds * 1000.0,
                )
            else:
                metrics.pull_failures.inc()
                await self._engine.abandon(rid)
            if self._live.is_aborted:
                if state.status is PullStatus.DONE:
                    await self._engine.abandon(rid)
                yield self._last(None, FinishReason.ABORT, 1)
                return
            text = TextDeltas(runtime.codec, already_sent=(first,))
            if state.status is PullStatus.DONE:
                outputs = self._engine.activate(rid)
            elif self._decode.pull_failure_policy is PullFailurePolicy.FAIL:
                raise Unavailable(
                    f"KV pull of {rid!r} from {handle.prefill_worker_id} failed ({state.message}); "
                    "the pull failure policy is fail: retry the request"
                )
            else:
                logger.warning(
                    "pull of %s failed (%s): recomputing the prompt locally", rid, state.message
                )
                self._usage = dataclasses.replace(self._usage, prefill_was_recomputed=True)
                metrics.recomputes.inc()
                outputs = self._recompute(first)
            async for chunk in self._relay(outputs, text, 1):
                yield chunk
        finally:
            # Whatever ended this call (finish, error, client cancel) after the pull returned: an
            # adopted request that never reached `activate` still holds its blocks. abandon() is a
            # no-op once the request was activated, so run it unconditionally (as an owned task:
            # this coroutine may be cancelled right here).
            self._deps.tasks.spawn(self._engine.abandon(rid), f"abandon {rid}")

    def _first_token_finish(self, first: int) -> FinishReason | None:
        sampling = self._request.sampling
        if first in sampling.stop_token_ids or (
            not sampling.ignore_eos and first == self._deps.runtime.eos_token_id
        ):
            return FinishReason.STOP
        return FinishReason.LENGTH if sampling.max_new_tokens <= 1 else None

    async def _adopt(self, engine_request, handle: KVHandle) -> tuple[int, ...] | None:
        """Blocks for the pulled prompt (None: the request was aborted while it waited). When
        none are free (or preempted requests wait for them), waits up to `ADOPT_WAIT_S` for
        running requests to finish, then refuses with RESOURCE_EXHAUSTED and a retry hint: an
        admitted request always makes progress (the scheduler preempts by recompute when
        decodes outgrow the pool), a refused one is told at once, nothing waits on blocks for
        a lease's lifetime. The refusal leaves P's lease alone: the KV is still good for
        another D (the router's retry); an abort while waiting releases it."""
        pull_timeout_s = self._deps.runtime.config.transfer.pull_timeout_s
        pull_window_s = handle.pull_window_s(pull_timeout_s, time.time())
        give_up_s = time.monotonic() + min(ADOPT_WAIT_S, max(0.0, pull_window_s))
        while True:
            adopting = asyncio.ensure_future(self._engine.adopt(engine_request))
            try:
                return await asyncio.shield(adopting)
            except asyncio.CancelledError:
                # The engine thread may still allocate the blocks: free them once it has.
                adopting.add_done_callback(self._abandon_when_done(engine_request.request_id))
                self._release_on_prefill(handle)
                raise
            except OutOfBlocks as exc:
                if self._live.is_aborted:  # the client ended it while it waited: P frees its KV
                    self._release_on_prefill(handle)
                    return None
                if time.monotonic() >= give_up_s:
                    # no room: P's lease stays for the router's retry on another D (or its TTL)
                    raise ResourceExhausted(
                        f"decode worker {self._deps.worker_id} has no free KV blocks for "
                        f"{handle.num_tokens} tokens ({exc.message})",
                        retry_after_s=1.0,
                    ) from exc
            except Dsv4Error:  # never adoptable here (e.g. it never fits): P can free it now
                self._release_on_prefill(handle)
                raise
            await asyncio.sleep(ADOPT_RETRY_INTERVAL_S)

    def _abandon_when_done(self, rid: str):
        """A done-callback that frees `rid`'s adopted blocks (an owned task; no-op if none)."""
        engine, tasks = self._engine, self._deps.tasks
        return lambda _: tasks.spawn(engine.abandon(rid), f"abandon {rid}")

    async def _pull_guarded(self, handle: KVHandle, dst_block_ids: tuple[int, ...]) -> PullState:
        """Run the pull as an owned task; if this call is cancelled, the task still finishes
        the transfer and only then frees the destination blocks."""
        rid = self._request.request_id
        task = self._deps.tasks.spawn(self._pull(handle, dst_block_ids), f"pull {rid}")
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._abandon_when_done(rid))
            self._release_on_prefill(handle)
            raise

    async def _pull(self, handle: KVHandle, dst_block_ids: tuple[int, ...]) -> PullState:
        transport = self._deps.runtime.transport
        assert transport is not None
        try:
            src = TransportEndpoint.from_bytes(handle.transport_metadata)
            exported = ExportedBlocks.from_bytes(handle.serialized_descriptors)
            pull = transport.start_pull(
                src, exported, list(dst_block_ids),
                timeout_s=self._deps.runtime.config.transfer.pull_timeout_s,
            )  # fmt: skip
        except Dsv4Error as exc:
            return PullState(PullStatus.FAILED, f"cannot start the pull: {exc.message}")
        while True:
            state = transport.poll(pull)
            if state.is_finished:
                return state
            await asyncio.sleep(PULL_POLL_INTERVAL_S)

    def _release_on_prefill(self, handle: KVHandle) -> None:
        if handle.prefill_address:
            coro = self._deps.prefill_clients.release(
                handle.prefill_address, handle.lease_id, handle.request_id
            )
            self._deps.tasks.spawn(coro, f"release {handle.lease_id}")

    async def _recompute(self, first: int) -> AsyncIterator[RequestOutput]:
        """Local prefill + decode after a failed pull; never re-sends P's first token."""
        runtime, request = self._deps.runtime, self._request
        # P's prompt logprobs went out with its token: the local run does not compute them again
        request = dataclasses.replace(
            request, sampling=dataclasses.replace(request.sampling, prompt_logprobs=None)
        )
        outputs = self._engine.generate(runtime.engine_request(request))
        head = await anext(outputs)
        if head.new_token_ids[:1] == (first,):  # P's token (and logprobs) went out already
            yield dataclasses.replace(
                head, new_token_ids=head.new_token_ids[1:], logprobs=head.logprobs[1:]
            )
            if not head.is_finished:
                async for out in outputs:
                    yield out
            return
        await outputs.aclose()  # the engine aborts the local run
        logger.warning(
            "%s: local first token %s != P's %d (unseeded sampling): continuing after P's token",
            request.request_id, head.new_token_ids[:1], first,
        )  # fmt: skip
        continuation = GenerateRequest(
            request_id=f"{request.request_id}#recompute",
            prompt_token_ids=(*request.prompt_token_ids, first),
            sampling=dataclasses.replace(
                request.sampling, max_new_tokens=request.sampling.max_new_tokens - 1
            ),
            priority=request.priority,
        )
        self._live.engine_request_id = continuation.request_id
        async for out in self._engine.generate(runtime.engine_request(continuation)):
            yield out

    # ---- streaming -------------------------------------------------------------------------------
    async def _relay(
        self, outputs: AsyncIterator[RequestOutput], text: TextDeltas, num_sent: int
    ) -> AsyncIterator[StreamChunk]:
        live = self._live
        try:
            async for out in outputs:
                live.is_streaming = True
                num_sent += len(out.new_token_ids)
                live.num_tokens_left = max(0, self._request.sampling.max_new_tokens - num_sent)
                delta = text.add(out.new_token_ids)
                if out.finish_reason is not None:
                    yield self._last(out, out.finish_reason.reason, num_sent, delta)
                    return
                if out.new_token_ids or delta:
                    yield StreamChunk(out.new_token_ids, delta, logprobs=out.logprobs,
                                      prompt_logprobs=out.prompt_logprobs)  # fmt: skip
                if live.is_aborted:
                    await self._engine.abort(live.engine_request_id)
                    yield self._last(None, FinishReason.ABORT, num_sent)
                    return
        except Cancelled:
            if not live.is_aborted:
                raise
            yield self._last(None, FinishReason.ABORT, num_sent)

    def _last(
        self, out: RequestOutput | None, reason: FinishReason, num_tokens: int, text: str = ""
    ) -> StreamChunk:
        usage = dataclasses.replace(self._usage, completion_tokens=num_tokens)
        if out is None:
            return StreamChunk(text=text, finish_reason=reason, usage=usage)
        return StreamChunk(out.new_token_ids, text, reason, usage, out.logprobs,
                           out.prompt_logprobs)  # fmt: skip
