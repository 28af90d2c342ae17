"""gRPC clients of the worker pools: one channel per worker address, reused by every call.

The only router module that touches worker stubs; what goes in and out are `dsv4.types`
dataclasses, converted by `dsv4.wire`. Every call carries the shared secret as metadata
`x-dsv4-token` (always configured: the router refuses to start without one), and runs over TLS when a CA or client certificate is set.
All methods run on the router's event loop. Failures surface as `WorkerCallError` (a worker
answered with a status or could not be reached) or `CallInterrupted` (the router cancelled the
call itself: Router.Abort, a worker marked down, shutdown).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc

from dsv4 import errors, wire
from dsv4.config import ServeConfig
from dsv4.rpc.v1 import worker_pb2, worker_pb2_grpc
from dsv4.serving.logs import request_metadata
from dsv4.types import (
    DecodeRequest,
    GenerateRequest,
    PrefillResult,
    ReleaseRequest,
    StreamChunk,
    WorkerInfo,
    WorkerRole,
)

logger = logging.getLogger(__name__)

TOKEN_METADATA_KEY = "x-dsv4-token"
RETIRE_GRACE_S = 30.0  # a channel of a worker that left discovery closes after this
MAX_RECONNECT_BACKOFF_MS = 1000

# Retry classification: the worker (or the path to it) is gone, or it is full; another worker
# may succeed. Any other code (INVALID_ARGUMENT, INTERNAL from a failed step, OUT_OF_RANGE, ...)
# is the request's own fault, which every worker would hit: returned at once, never retried.
UNREACHABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
RETRIABLE_CODES = UNREACHABLE_CODES | {grpc.StatusCode.RESOURCE_EXHAUSTED}
_ERROR_FOR_CODE: dict[grpc.StatusCode, type[errors.Dsv4Error]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.CANCELLED: errors.Unavailable,  # the worker dropped the call (shutdown)
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.FAILED_PRECONDITION: errors.LayoutMismatch,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
}


class WorkerCallError(Exception):
    """A worker call ended with a gRPC status. `to_dsv4_error` is what the client should see."""

    def __init__(self, address: str, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method} on {address}: {code.name}: {details}")
        self.address, self.method, self.code, self.details = address, method, code, details

    @property
    def is_unreachable(self) -> bool:
        return self.code in UNREACHABLE_CODES

    @property
    def is_retriable(self) -> bool:  # another worker may succeed
        return self.code in RETRIABLE_CODES

    def to_dsv4_error(self) -> errors.Dsv4Error:
        """What the client sees: the worker's code and message, naming the worker."""
        if self.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return errors.Dsv4Error(
                f"worker {self.address} refused the router ({self.code.name}): check that "
                "security.shared_secret and the TLS settings match on router and workers"
            )
        error = _ERROR_FOR_CODE.get(self.code, errors.Dsv4Error)(
            f"{self.method} on worker {self.address} failed: {self.details}"
        )
        if self.code not in _ERROR_FOR_CODE:  # keep the worker's code (OUT_OF_RANGE, UNKNOWN)
            error.grpc_code = self.code.name
        return error


class CallInterrupted(Exception):
    """The router cancelled this call itself; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class ClientSettings:
    max_message_bytes: int = 16 << 20
    shared_secret: str = ""
    tls_ca_path: str = ""
    tls_cert_path: str = ""  # presented to workers only with mutual TLS
    tls_key_path: str = ""
    use_client_cert: bool = False

    @classmethod
    def from_config(cls, cfg: ServeConfig) -> ClientSettings:
        s = cfg.security
        return cls(
            max_message_bytes=cfg.router.max_message_bytes,
            shared_secret=s.shared_secret,
            tls_ca_path=s.tls_ca_path,
            tls_cert_path=s.tls_cert_path,
            tls_key_path=s.tls_key_path,
            use_client_cert=s.require_client_cert,
        )

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls_ca_path or self.use_client_cert)


class WorkerCall:
    """One in-flight worker call (base of PrefillCall / DecodeCall). A local cancel through
    `interrupt` surfaces as CallInterrupted; a cancel of the awaiting task (client went away)
    stays CancelledError and still cancels the worker's RPC."""

    def __init__(self, call: grpc.aio.Call, address: str, method: str) -> None:
        self._call, self.address, self.method = call, address, method
        self._interrupt_reason: str | None = None

    def interrupt(self, reason: str) -> None:
        """Cancel the call (the worker sees its RPC cancelled); the awaiting side raises
        CallInterrupted(reason). Safe to call at any time, from the event loop."""
        if self._interrupt_reason is None:
            self._interrupt_reason = reason
        self._call.cancel()

    def _malformed(self, exc: errors.Dsv4Error) -> WorkerCallError:
        details = f"malformed answer (worker bug or API version skew): {exc}"
        return WorkerCallError(self.address, self.method, grpc.StatusCode.INTERNAL, details)

    def _translate(self, exc: BaseException) -> BaseException:
        task = asyncio.current_task()
        if isinstance(exc, asyncio.CancelledError):
            self._call.cancel()  # the awaiting task was cancelled: the worker must hear of it
            if task is not None and task.cancelling():
                return exc  # the client went away (or shutdown): stays a cancellation
            # Only the call was cancelled (interrupt, or its channel closed): a status follows.
            return CallInterrupted(
                self._interrupt_reason
                or f"the router closed its channel to worker {self.address} mid-call"
            )
        if isinstance(exc, grpc.aio.AioRpcError):
            return WorkerCallError(self.address, self.method, exc.code(), exc.details() or "")
        return exc


class PrefillCall(WorkerCall):
    async def result(self) -> PrefillResult:
        try:
            msg = await self._call
        except (asyncio.CancelledError, grpc.aio.AioRpcError) as exc:
            raise self._translate(exc) from exc
        try:
            return wire.prefill_result_from_proto(msg)
        except errors.Dsv4Error as exc:
            raise self._malformed(exc) from exc


class DecodeCall(WorkerCall):
    async def read(self) -> StreamChunk | None:
        """The next DecodeResponse as a StreamChunk; None when the worker closed the stream
        with OK (whether or not it sent a last message: the flow checks)."""
        try:
            msg = await self._call.read()
        except (asyncio.CancelledError, grpc.aio.AioRpcError) as exc:
            raise self._translate(exc) from exc
        if msg is grpc.aio.EOF:
            return None
        try:
            return wire.decode_response_from_proto(msg)
        except errors.Dsv4Error as exc:
            raise self._malformed(exc) from exc


class WorkerClients:
    """Channels and stubs per worker address. Owned by the RouterServer; `close()` at stop."""

    def __init__(self, settings: ClientSettings) -> None:
        self._settings = settings
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._retiring: dict[asyncio.Task[None], grpc.aio.Channel] = {}
        self._metadata: tuple[tuple[str, str], ...] = (
            ((TOKEN_METADATA_KEY, settings.shared_secret),) if settings.shared_secret else ()
        )
        self._credentials = self._make_credentials() if settings.uses_tls else None

    def _make_credentials(self) -> grpc.ChannelCredentials:
        s = self._settings
        root = Path(s.tls_ca_path).read_bytes() if s.tls_ca_path else None
        if s.use_client_cert:
            return grpc.ssl_channel_credentials(
                root, Path(s.tls_key_path).read_bytes(), Path(s.tls_cert_path).read_bytes()
            )
        return grpc.ssl_channel_credentials(root)

    def channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            size = self._settings.max_message_bytes
            options = [
                ("grpc.max_send_message_length", size),
                ("grpc.max_receive_message_length", size),
                # A restarted worker must be usable within about a probe interval, not after
                # gRPC's default reconnect backoff (up to 120 s).
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
            ]
            if self._credentials is not None:
                channel = grpc.aio.secure_channel(address, self._credentials, options)
            else:
                channel = grpc.aio.insecure_channel(address, options)
            self._channels[address] = channel
        return channel

    def start_prefill(
        self, address: str, request: GenerateRequest, timeout_s: float
    ) -> PrefillCall:
        stub = worker_pb2_grpc.PrefillWorkerStub(self.channel(address))
        call = stub.Prefill(
            wire.prefill_request_to_proto(request),
            timeout=timeout_s,
            metadata=self._metadata + request_metadata(request.request_id),
        )
        return PrefillCall(call, address, "Prefill")

    def start_decode(self, address: str, request: DecodeRequest, timeout_s: float) -> DecodeCall:
        stub = worker_pb2_grpc.DecodeWorkerStub(self.channel(address))
        call = stub.Decode(
            wire.decode_request_to_proto(request),
            timeout=timeout_s,
            metadata=self._metadata + request_metadata(request.request.request_id),
        )
        return DecodeCall(call, address, "Decode")

    async def info(self, address: str, listed_role: WorkerRole, timeout_s: float) -> WorkerInfo:
        """Info through the service of the pool the worker is listed in (a colocated engine is
        listed as decode and serves DecodeWorker). Raises WorkerCallError."""
        channel = self.channel(address)
        if listed_role is WorkerRole.PREFILL:
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        else:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        try:
            msg = await stub.Info(
                worker_pb2.InfoRequest(), timeout=timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise WorkerCallError(address, "Info", exc.code(), exc.details() or "") from exc
        return wire.worker_info_from_proto(msg)

    async def release(self, address: str, lease_id: str, request_id: str, timeout_s: float) -> bool:
        """End a lease on P; returns was_found. Raises WorkerCallError."""
        stub = worker_pb2_grpc.PrefillWorkerStub(self.channel(address))
        request = wire.release_request_to_proto(ReleaseRequest(lease_id, request_id))
        try:
            metadata = self._metadata + request_metadata(request_id)
            msg = await stub.Release(request, timeout=timeout_s, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise WorkerCallError(address, "Release", exc.code(), exc.details() or "") from exc
        return wire.release_result_from_proto(msg).was_found

    async def abort_decode(self, address: str, request_id: str, timeout_s: float) -> bool:
        """Abort a decode on D; returns was_found. Raises WorkerCallError."""
        stub = worker_pb2_grpc.DecodeWorkerStub(self.channel(address))
        request = wire.abort_request_to_proto(request_id)
        try:
            metadata = self._metadata + request_metadata(request_id)
            msg = await stub.Abort(request, timeout=timeout_s, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise WorkerCallError(address, "Abort", exc.code(), exc.details() or "") from exc
        return wire.abort_response_from_proto(msg)

    def retire(self, address: str) -> None:
        """A worker left discovery: close its channel after RETIRE_GRACE_S (calls still on it
        may finish). Owned tasks; `close()` ends them."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            task = asyncio.create_task(channel.close(RETIRE_GRACE_S), name=f"retire {address}")
            self._retiring[task] = channel
            task.add_done_callback(lambda done: self._retiring.pop(done, None))

    async def close(self) -> None:
        """Close every channel now (calls still on them are cancelled). Idempotent."""
        retiring = dict(self._retiring)
        for task in retiring:
            task.cancel()
        await asyncio.gather(*retiring, return_exceptions=True)
        channels = [*self._channels.values(), *retiring.values()]
        self._channels.clear()
        await asyncio.gather(*(channel.close(None) for channel in channels), return_exceptions=True)
