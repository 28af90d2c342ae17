"""Scripted PrefillWorker / DecodeWorker servicers: deterministic stand-ins for the router's
control-flow tests (no engine, no KV, no NIXL).

Token rule: the token after a sequence of length n is `(FIRST_TOKEN_BASE + n) % vocab_size`, so
P's first token and D's stream continue each other, and a migrated request (prompt + tokens so
far) produces exactly what an uninterrupted one would. Each worker records what it saw
(requests, releases, aborts, cancelled calls) for the test to check, and can be scripted to
fail, hang or close its stream early. Requests are validated with `dsv4.wire`, as real workers do.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from dsv4 import wire
from dsv4.errors import Dsv4Error, to_grpc_status
from dsv4.rpc.v1 import worker_pb2, worker_pb2_grpc
from dsv4.types import (
    FinishReason,
    KVHandle,
    KVLayoutInfo,
    PrefillResult,
    RequestLimits,
    StreamChunk,
    TransportKind,
    Usage,
    WorkerInfo,
    WorkerRole,
)
from router_svc.clients import TOKEN_METADATA_KEY

FIRST_TOKEN_BASE = 300  # merged byte-level tokens of the tiny tokenizer: readable text
HANG_S = 3600.0  # "forever": until the call is cancelled


def next_token(num_tokens_so_far: int, vocab_size: int) -> int:
    return (FIRST_TOKEN_BASE + num_tokens_so_far) % vocab_size


@dataclass
class WorkerScript:
    """What a scripted worker does. Counts are tokens streamed by D (after the first token)."""

    layout_hash: str = "layout-a"
    vocab_size: int = 1000
    max_model_len: int = 4096
    num_free_blocks: int = 100
    num_queued_tokens: int = 0
    is_draining: bool = False
    info_mode: str = "ok"  # "ok" | "fail" (UNAVAILABLE) | "hang"
    fail_code: grpc.StatusCode | None = None  # Prefill / Decode answer this at once
    fail_calls: int | None = None  # D: only its first `fail_calls` Decode calls fail so
    lease_ttl_s: float = 0.0  # P: the handle's lease lasts this long (0: already expired)
    delay_s: float = 0.0  # before P answers / before D's first message
    token_delay_s: float = 0.0  # between D's messages
    fail_after: int | None = None  # D: `fail_after_code` after this many tokens
    fail_after_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    close_after: int | None = None  # D: end the stream (OK) without a last message
    hang_after: int | None = None  # D: stop sending after this many tokens
    kv_transfer_bytes: int = 4096
    required_token: str = ""  # refuse calls without this x-dsv4-token
    speculative_method: str = "none"  # what Info reports


@dataclass
class WorkerLog:
    requests: list = field(default_factory=list)  # GenerateRequest / DecodeRequest seen
    released: list[str] = field(default_factory=list)  # lease ids
    aborted: list[str] = field(default_factory=list)  # request ids (Abort RPC)
    cancelled: list[str] = field(default_factory=list)  # request ids whose call was cancelled
    num_info_calls: int = 0


class _ScriptedBase:
    role: WorkerRole

    def __init__(self, worker_id: str, script: WorkerScript | None = None) -> None:
        self.worker_id = worker_id
        self.script = script or WorkerScript()
        self.log = WorkerLog()
        self.address = ""
        self._server: grpc.aio.Server | None = None

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(
            vocab_size=self.script.vocab_size, max_model_len=self.script.max_model_len
        )

    async def start(self, credentials: grpc.ServerCredentials | None = None, port: int = 0) -> str:
        """Serve on loopback (a free port unless given; TLS with `credentials`); returns the
        address. A stopped worker can be started again on its old port (a restart)."""
        server = grpc.aio.server()
        self._register(server)
        if credentials is not None:
            port = server.add_secure_port(f"127.0.0.1:{port}", credentials)
        else:
            port = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        self._server, self.address = server, f"127.0.0.1:{port}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)
            self._server = None

    @property
    def is_serving(self) -> bool:
        return self._server is not None

    def _register(self, server: grpc.aio.Server) -> None:
        raise NotImplementedError

    async def _check(self, context: grpc.aio.ServicerContext) -> None:
        if self.script.required_token:
            sent = dict(context.invocation_metadata() or ()).get(TOKEN_METADATA_KEY, "")
            if sent != self.script.required_token:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")

    async def Info(self, request, context):
        self.log.num_info_calls += 1
        await self._check(context)
        if self.script.info_mode == "fail":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted Info failure")
        if self.script.info_mode == "hang":
            await asyncio.sleep(HANG_S)
        s = self.script
        info = WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,
            address=self.address,
            layout=KVLayoutInfo(1, s.layout_hash, 4096, 256),
            num_free_blocks=s.num_free_blocks,
            num_total_blocks=max(s.num_free_blocks, 1),
            num_queued_tokens=s.num_queued_tokens,
            is_draining=s.is_draining,
            model_name="scripted",
            vocab_size=s.vocab_size,
            max_model_len=s.max_model_len,
            speculative_method=s.speculative_method,
        )
        return wire.worker_info_to_proto(info)

    async def Drain(self, request, context):
        self.script.is_draining = True
        return worker_pb2.DrainResponse()


class ScriptedPrefillWorker(_ScriptedBase, worker_pb2_grpc.PrefillWorkerServicer):
    role = WorkerRole.PREFILL

    def _register(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self, server)

    async def Prefill(self, request, context):
        await self._check(context)
        try:
            gen = wire.prefill_request_from_proto(request, self.limits)
        except Dsv4Error as exc:
            await context.abort(*to_grpc_status(exc))
        self.log.requests.append(gen)
        if self.script.fail_code is not None:
            await context.abort(self.script.fail_code, f"scripted {self.script.fail_code.name}")
        try:
            await asyncio.sleep(self.script.delay_s)
        except asyncio.CancelledError:
            self.log.cancelled.append(gen.request_id)
            raise
        handle = KVHandle(
            request_id=gen.request_id,
            prefill_worker_id=self.worker_id,
            transport_kind=TransportKind.LOCAL,
            transport_endpoint=self.address,
            block_ids=(0,),
            layout_hash=self.script.layout_hash,
            num_tokens=gen.num_prompt_tokens,
            lease_id=f"lease-{gen.request_id}",
            lease_expires_at_unix_ms=int((time.time() + self.script.lease_ttl_s) * 1000)
            if self.script.lease_ttl_s
            else 0,
        )
        first = next_token(gen.num_prompt_tokens, self.script.vocab_size)
        return wire.prefill_result_to_proto(PrefillResult(first_token_id=first, handle=handle))

    async def Release(self, request, context):
        await self._check(context)
        release = wire.release_request_from_proto(request)
        self.log.released.append(release.lease_id)
        return worker_pb2.ReleaseResponse(was_found=True, num_freed_blocks=1)


class ScriptedDecodeWorker(_ScriptedBase, worker_pb2_grpc.DecodeWorkerServicer):
    """A decode worker, or with `colocated=True` an engine that prefills itself."""

    def __init__(
        self, worker_id: str, script: WorkerScript | None = None, *, colocated: bool = False
    ) -> None:
        super().__init__(worker_id, script)
        self.role = WorkerRole.COLOCATED if colocated else WorkerRole.DECODE

    def _register(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(self, server)

    async def Abort(self, request, context):
        await self._check(context)
        self.log.aborted.append(wire.abort_request_from_proto(request))
        return wire.abort_response_to_proto(True)

    async def Decode(self, request, context):
        await self._check(context)
        try:
            decode = wire.decode_request_from_proto(request, self.limits)
        except Dsv4Error as exc:
            await context.abort(*to_grpc_status(exc))
        self.log.requests.append(decode)
        s, req = self.script, decode.request
        if s.fail_code is not None and (
            s.fail_calls is None or len(self.log.requests) <= s.fail_calls
        ):
            await context.abort(s.fail_code, f"scripted {s.fail_code.name}")
        start = 0 if decode.needs_local_prefill else 1  # position 0 is P's first token
        max_new_tokens = req.sampling.max_new_tokens
        try:
            await asyncio.sleep(s.delay_s)
            for position in range(start, max_new_tokens):
                streamed = position - start
                if streamed == s.fail_after:
                    await context.abort(s.fail_after_code, "scripted failure mid-stream")
                if streamed == s.close_after:
                    return
                if streamed == s.hang_after:
                    await asyncio.sleep(HANG_S)
                if streamed:
                    await asyncio.sleep(s.token_delay_s)
                token = next_token(req.num_prompt_tokens + position, s.vocab_size)
                is_last = position == max_new_tokens - 1
                yield wire.decode_response_to_proto(
                    self._chunk(decode.handle, token, is_last, max_new_tokens)
                )
            if start >= max_new_tokens:
                yield wire.decode_response_to_proto(
                    self._chunk(decode.handle, None, True, max_new_tokens)
                )
        except asyncio.CancelledError:
            self.log.cancelled.append(req.request_id)
            raise

    def _chunk(
        self, handle: KVHandle | None, token: int | None, is_last: bool, num_tokens: int
    ) -> StreamChunk:
        usage = Usage(
            completion_tokens=num_tokens,
            decode_worker_id=self.worker_id,
            kv_transfer_bytes=self.script.kv_transfer_bytes if handle is not None else 0,
            kv_transfer_ms=1.5 if handle is not None else 0.0,
        )
        return StreamChunk(
            token_ids=(token,) if token is not None else (),
            finish_reason=FinishReason.LENGTH if is_last else None,
            usage=usage if is_last else None,
        )


__all__ = [
    "FIRST_TOKEN_BASE",
    "ScriptedDecodeWorker",
    "ScriptedPrefillWorker",
    "WorkerLog",
    "WorkerScript",
    "next_token",
]
