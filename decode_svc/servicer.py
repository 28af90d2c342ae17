"""`dsv4.v1.DecodeWorker`: pull a prompt's KV from a prefill worker and stream the tokens.

Decode runs one `DecodeSession` per call (pull, recompute and colocated logic live there);
Abort ends a running call with FINISH_REASON_ABORT (during a pull it waits for the transfer to
finish first, so blocks are never freed under an in-flight READ); Info reports load; Drain stops
taking new work. Runs on the worker's event loop; every error leaves through `abort_with`.
"""

from __future__ import annotations

import logging

import grpc

from decode_svc.prefill_client import PrefillClients
from decode_svc.session import DecodeDeps, DecodeSession, Live
from dsv4 import wire
from dsv4.errors import DeadlineExceeded, Dsv4Error, InvalidRequest, Unavailable
from dsv4.rpc.v1 import worker_pb2_grpc
from dsv4.serving.logs import bind_request_id
from dsv4.serving.metrics import DecodeMetrics, new_registry
from dsv4.serving.tasks import TaskOwner
from dsv4.types import DrainStatus, StreamChunk, WorkerInfo
from dsv4.worker.build import WorkerRuntime
from dsv4.worker.identity import (
    WorkerIdentity,
    WorkerLoad,
    mtp_counts,
    undrain,
    worker_info,
    worker_metrics,
)
from dsv4.worker.server import abort_with

logger = logging.getLogger(__name__)

SERVICE_NAME = "dsv4.v1.DecodeWorker"


class DecodeService(worker_pb2_grpc.DecodeWorkerServicer):
    SERVICE_NAME = SERVICE_NAME  # the class attribute `dsv4.commands.worker` reads

    def __init__(self, runtime: WorkerRuntime, identity: WorkerIdentity) -> None:
        self.runtime = runtime
        self.identity = identity
        self._tasks = TaskOwner("decode")
        self._prefill_clients = PrefillClients(runtime.config)
        self._live: dict[str, Live] = {}
        self.is_draining = False
        self.is_stopping = False  # set by dsv4.commands.worker at SIGTERM; Undrain is refused then
        self.registry = new_registry()
        self.metrics = DecodeMetrics.create(
            self.registry,
            worker_metrics(
                self.registry, runtime, identity,
                num_running=lambda: len(self._live), is_draining=lambda: self.is_draining,
            ),
            mtp_counts=lambda: mtp_counts(runtime),
        )  # fmt: skip
        self._deps = DecodeDeps(
            runtime, identity.worker_id, self._tasks, self._prefill_clients, self.metrics
        )

    def add_to_server(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(self, server)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        await self._tasks.close(timeout_s=self.runtime.config.transfer.pull_timeout_s)
        await self._prefill_clients.close()

    def info(self) -> WorkerInfo:
        load = WorkerLoad(
            num_running_requests=len(self._live),
            num_queued_tokens=sum(x.num_tokens_left for x in self._live.values()),
            num_leases=0,
            # an engine that cannot step takes no work: the router routes around it
            is_draining=self.is_draining or not self.runtime.engine.can_step,
        )
        return worker_info(self.runtime, self.identity, load)

    def drain_status(self) -> DrainStatus:
        return DrainStatus(num_running_requests=len(self._live) + len(self._tasks))

    # ---- RPCs ----------------------------------------------------------------------------------
    async def Decode(self, request, context):
        bind_request_id(request.request.request_id, context.invocation_metadata())
        try:
            decode = wire.decode_request_from_proto(request, self.runtime.limits)
            rid = decode.request.request_id
            if self.is_draining:
                raise Unavailable(f"decode worker {self.identity.worker_id} is draining")
            if rid in self._live:
                raise InvalidRequest(f"request id {rid!r} is already decoding here")
            deadline_ms = decode.request.deadline_unix_ms
            if deadline_ms is not None and deadline_ms <= _now_ms():
                raise DeadlineExceeded(f"request {rid!r} reached its deadline before decode")
            live = Live(rid, rid, decode.request.sampling.max_new_tokens)
            self._live[rid] = live
            try:
                async for chunk in DecodeSession(self._deps, decode, live).run():
                    if chunk.usage is not None:
                        _log_finish(chunk)
                    yield wire.decode_response_to_proto(chunk)
            finally:
                if self._live.get(rid) is live:
                    del self._live[rid]
        except Dsv4Error as exc:
            logger.info("decode failed: %s", exc)
            await abort_with(context, exc)

    async def Abort(self, request, context):
        try:
            rid = wire.abort_request_from_proto(request)
        except Dsv4Error as exc:
            await abort_with(context, exc)
        bind_request_id(rid)
        live = self._live.get(rid)
        if live is None:
            return wire.abort_response_to_proto(False)
        live.is_aborted = True
        if live.is_streaming:  # before that, the session checks the flag itself
            await self.runtime.engine.abort(live.engine_request_id)
        return wire.abort_response_to_proto(True)

    async def Info(self, request, context):
        return wire.worker_info_to_proto(self.info())

    async def Drain(self, request, context):
        self.is_draining = True
        return wire.drain_status_to_proto(self.drain_status())

    async def Undrain(self, request, context):
        await undrain(self, context)
        return wire.drain_status_to_proto(self.drain_status())


def _log_finish(last: StreamChunk) -> None:
    usage = last.usage
    assert usage is not None and last.finish_reason is not None
    logger.info(
        "decode finished (%s): %d tokens; KV %d bytes in %.1f ms%s",
        last.finish_reason.value, usage.completion_tokens, usage.kv_transfer_bytes,
        usage.kv_transfer_ms, "; prefill recomputed" if usage.prefill_was_recomputed else "",
    )  # fmt: skip


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)
