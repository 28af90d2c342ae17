"""`dsv4.v1.PrefillWorker`: prefill a prompt, sample the first token, lend the KV under a lease.

Prefill: validate (the worker re-checks what the router sends) -> `AsyncEngine.prefill` (the
blocks stay held) -> export them through the transport under a lease (`LeaseTable`) -> answer
{first token, KVHandle}. The handle carries the transport endpoint and exported-blocks record
(opaque bytes for D), the layout hash and P's own gRPC address (D's Release goes there).
A cancelled call frees whatever it produced. Release ends a lease; Info reports load; Drain
stops taking new work. Runs on the worker's event loop; a bad request never crashes it: every
error leaves through `abort_with` as the status `dsv4.errors.to_grpc_status` maps it to.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time

import grpc

from dsv4 import wire
from dsv4.engine.async_engine import AsyncEngine
from dsv4.errors import DeadlineExceeded, Dsv4Error, Unavailable
from dsv4.rpc.v1 import worker_pb2_grpc
from dsv4.serving.logs import bind_request_id
from dsv4.serving.metrics import PrefillMetrics, new_registry
from dsv4.serving.tasks import TaskOwner
from dsv4.types import (
    DrainStatus,
    GenerateRequest,
    KVHandle,
    PrefillResult,
    PrefillTimings,
    TransportKind,
    WorkerInfo,
)
from dsv4.worker.build import WorkerRuntime
from dsv4.worker.identity import WorkerIdentity, WorkerLoad, undrain, worker_info, worker_metrics
from dsv4.worker.server import abort_with
from prefill_svc.leases import LeaseTable

logger = logging.getLogger(__name__)

SERVICE_NAME = "dsv4.v1.PrefillWorker"


class PrefillService(worker_pb2_grpc.PrefillWorkerServicer):
    SERVICE_NAME = SERVICE_NAME  # the class attribute `dsv4.commands.worker` reads

    def __init__(self, runtime: WorkerRuntime, identity: WorkerIdentity) -> None:
        assert runtime.transport is not None, "a prefill worker needs a KV transport"
        self.runtime = runtime
        self.identity = identity
        self.leases = LeaseTable(
            runtime.engine, runtime.transport, runtime.config.transfer.lease_ttl_s
        )
        self._tasks = TaskOwner("prefill")
        self._endpoint = runtime.transport.endpoint()
        self._endpoint_bytes = self._endpoint.to_bytes()
        self._running: dict[str, int] = {}  # request id -> prompt tokens
        self.is_draining = False
        self.is_stopping = False  # set by dsv4.commands.worker at SIGTERM; Undrain is refused then
        self.registry = new_registry()
        self.metrics = PrefillMetrics.create(
            self.registry,
            worker_metrics(
                self.registry, runtime, identity,
                num_running=lambda: len(self._running), is_draining=lambda: self.is_draining,
            ),
            queued_tokens=lambda: runtime.engine.load().num_queued_prefill_tokens,
            leases_live=lambda: len(self.leases),
            lease_expiries=lambda: self.leases.num_expired,
        )  # fmt: skip

    def add_to_server(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self, server)

    async def start(self) -> None:
        self.leases.start()

    async def stop(self) -> None:
        await self._tasks.close(timeout_s=2.0)
        await self.leases.stop()

    def info(self) -> WorkerInfo:
        load = WorkerLoad(
            num_running_requests=len(self._running),
            num_queued_tokens=sum(self._running.values()),
            num_leases=len(self.leases),
            # an engine that cannot step takes no work: the router routes around it
            is_draining=self.is_draining or not self.runtime.engine.can_step,
        )
        return worker_info(self.runtime, self.identity, load)

    def drain_status(self) -> DrainStatus:
        return DrainStatus(len(self._running), len(self.leases))

    # ---- RPCs ----------------------------------------------------------------------------------
    async def Prefill(self, request, context):
        bind_request_id(request.request.request_id, context.invocation_metadata())
        try:
            if self.is_draining:
                raise Unavailable(f"prefill worker {self.identity.worker_id} is draining")
            generate_request = wire.prefill_request_from_proto(request, self.runtime.limits)
            result = await self._prefill(generate_request)
            return wire.prefill_result_to_proto(result)
        except Dsv4Error as exc:
            await abort_with(context, exc)

    async def Release(self, request, context):
        bind_request_id(request.request_id, context.invocation_metadata())
        try:
            release = wire.release_request_from_proto(request)
            result = await self.leases.release(release.lease_id, release.request_id)
            logger.debug("Release %s: was_found=%s", release.lease_id, result.was_found)
            return wire.release_result_to_proto(result)
        except Dsv4Error as exc:
            await abort_with(context, exc)

    async def Info(self, request, context):
        return wire.worker_info_to_proto(self.info())

    async def Drain(self, request, context):
        self.is_draining = True
        return wire.drain_status_to_proto(self.drain_status())

    async def Undrain(self, request, context):
        await undrain(self, context)
        return wire.drain_status_to_proto(self.drain_status())

    # ---- the prefill ---------------------------------------------------------------------------
    async def _prefill(self, request: GenerateRequest) -> PrefillResult:
        rid = request.request_id
        if request.deadline_unix_ms is not None and request.deadline_unix_ms <= time.time() * 1000:
            raise DeadlineExceeded(f"request {rid!r} reached its deadline before prefill")
        if rid in self._running:
            raise Dsv4Error(f"request id {rid!r} is already being prefilled here")
        engine = self.runtime.engine
        started_s = time.monotonic()
        self._running[rid] = request.num_prompt_tokens
        try:
            outcome = await engine.prefill(self.runtime.engine_request(request))
            if outcome.held is None:
                raise Unavailable(f"prefill of {rid!r} kept no blocks (engine stopped?)")
            try:
                lease, exported = self.leases.export(rid, outcome.held.block_ids)
            except BaseException:
                await engine.release_hold(rid)
                raise
        except BaseException:
            # A cancel can land after the engine took a hold; abort frees it (idempotent).
            self._tasks.spawn(_quiet_abort(engine, rid), f"abort {rid}")
            raise
        finally:
            self._running.pop(rid, None)
        compute_ms = (time.monotonic() - started_s) * 1000.0
        self.metrics.exports.inc()
        self.metrics.prefill_time.observe(compute_ms / 1000.0)
        logger.info(
            "prefilled %d tokens in %.1f ms; lease %s holds %d blocks",
            request.num_prompt_tokens, compute_ms, lease.lease_id, lease.num_blocks,
        )  # fmt: skip
        budget = self.runtime.config.scheduler.max_num_batched_tokens
        handle = KVHandle(
            request_id=rid,
            prefill_worker_id=self.identity.worker_id,
            transport_kind=TransportKind(self._endpoint.kind),
            transport_endpoint=self._endpoint.peer_id,
            block_ids=outcome.held.block_ids,
            layout_hash=self.runtime.layout.compat_hash,
            num_tokens=outcome.held.num_tokens,
            lease_id=lease.lease_id,
            lease_expires_at_unix_ms=lease.expires_at_unix_ms,
            prefill_address=self.identity.address,
            transport_metadata=self._endpoint_bytes,
            serialized_descriptors=exported.to_bytes(),
        )
        codec = self.runtime.codec
        return PrefillResult(
            first_token_id=outcome.first_token,
            handle=handle,
            timings=PrefillTimings(
                queue_ms=0.0,  # NOTE: the engine does not report queueing apart from compute yet
                compute_ms=compute_ms,
                num_chunks=math.ceil(request.num_prompt_tokens / budget),
            ),
            first_token_text=codec.decode_delta([outcome.first_token], 0) if codec else "",
            first_token_logprobs=outcome.first_token_logprobs,
            prompt_logprobs=outcome.prompt_logprobs,
        )


async def _quiet_abort(engine: AsyncEngine, request_id: str) -> None:
    """Best effort: an engine that stopped has nothing left to free."""
    with contextlib.suppress(Dsv4Error):
        await engine.abort(request_id)
