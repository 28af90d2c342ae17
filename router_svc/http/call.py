"""One Router.Generate call made in-process: the gRPC servicer's own code path, no network hop.

`InProcessCall` stands in for `grpc.aio.ServicerContext` (the part the servicer uses: metadata,
peer, deadline, write, status, trailing metadata) and runs `RouterServicer.Generate` as a task
owned by the call, so an HTTP request gets exactly what a gRPC one gets: API key, rate limit,
admission, validation, the request flow, its metrics and logs. `stream()` yields the chunks;
when the call ends with an error status it raises `ApiError` (before any chunk, the HTTP
handler answers with that status; after, it reports it inside the stream). Closing the stream
early (the HTTP client went away) cancels the task as gRPC cancels a handler whose client
left: the flow's cleanup aborts the request on D and releases P's lease.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

from dsv4 import wire
from dsv4.rpc.v1 import router_pb2
from dsv4.types import StreamChunk
from router_svc.http.errors import ApiError
from router_svc.servicer import RETRY_PUSHBACK_KEY, RouterServicer

MAX_BUFFERED_CHUNKS = 16  # chunks written but not yet sent: Generate waits beyond this
_END = object()


class _Aborted(Exception):
    """`abort()` was called: the servicer ends the call with the status already set."""


class InProcessCall:
    """Create per HTTP request; iterate `stream()` once (inside `contextlib.aclosing`)."""

    def __init__(
        self,
        servicer: RouterServicer,
        request: router_pb2.GenerateRequest,
        *,
        metadata: Sequence[tuple[str, str]],
        peer: str,
        rate_limit_paid: bool = False,
        counts_prompt: bool = True,
    ) -> None:
        self._servicer, self._request = servicer, request
        self._metadata, self._peer = tuple(metadata), peer
        # the HTTP request's rate limit was charged for all its choices at once
        # (RouterServicer.charge_rate_limit): the servicer skips it for this call
        self.rate_limit_paid = rate_limit_paid
        # False for a prompt's choices after its first: vllm:prompt_tokens_total counts each
        # prompt of a request once, as vLLM and the answer's usage do
        self.counts_prompt = counts_prompt
        self._queue: asyncio.Queue[Any] = asyncio.Queue()  # unbounded: the end always fits
        self._room = asyncio.Semaphore(MAX_BUFFERED_CHUNKS)
        self._code: Any = None  # a grpc.StatusCode once the servicer set one
        self._details = ""
        self._trailing: tuple[tuple[str, str], ...] = ()
        self._task: asyncio.Task[None] | None = None

    # ---- the part of grpc.aio.ServicerContext the servicer uses ---------------------------------

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return None  # HTTP clients send no deadline: router.request_timeout_s applies

    async def write(self, message: router_pb2.GenerateResponse) -> None:
        await self._room.acquire()
        self._queue.put_nowait(wire.generate_response_from_proto(message))

    def set_code(self, code: Any) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._trailing = tuple(metadata)

    def cancelled(self) -> bool:
        return self._task is not None and self._task.cancelled()

    def done(self) -> bool:
        return self._task is not None and self._task.done()

    async def abort(self, code: Any, details: str = "", trailing_metadata: Any = ()) -> None:
        self._code, self._details, self._trailing = code, details, tuple(trailing_metadata)
        raise _Aborted(details)

    # ---- the HTTP side --------------------------------------------------------------------------

    async def _serve(self) -> None:
        try:
            await self._servicer.Generate(self._request, self)  # type: ignore[arg-type]
        except _Aborted:
            pass
        finally:
            self._queue.put_nowait(_END)

    async def stream(self) -> AsyncIterator[StreamChunk]:
        """The call's chunks; raises ApiError when it ended with an error status."""
        self._task = asyncio.create_task(self._serve(), name="http Generate")
        try:
            while (item := await self._queue.get()) is not _END:
                self._room.release()
                yield item
            await self._task  # re-raises what escaped the servicer (a bug: HTTP 500)
            if self._code is not None and self._code.name != "OK":
                raise ApiError.from_grpc(self._code.name, self._details, self._retry_after_s())
        finally:
            if not self._task.done():
                self._task.cancel()  # the client left: the flow's cleanup frees P and D
                await asyncio.gather(self._task, return_exceptions=True)

    def _retry_after_s(self) -> float | None:
        pushback_ms = dict(self._trailing).get(RETRY_PUSHBACK_KEY)
        return math.ceil(int(pushback_ms) / 1000) if pushback_ms else None
