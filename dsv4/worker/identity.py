"""Who a worker is, what it reports, and how that reaches discovery (the heartbeat wiring).

`WorkerIdentity` is fixed once the gRPC port is bound. Services build their `WorkerInfo` (Info
RPC) with `worker_info`; `start_heartbeat` publishes the same facts as a `WorkerRecord` to the
Redis registry every `discovery.heartbeat_s` (static discovery needs no publishing: the router's
lists name the workers and it probes them with Info).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from dsv4.config import ServeConfig
from dsv4.discovery import WorkerHeartbeat, WorkerRecord, make_registry
from dsv4.discovery.base import WorkerRegistry
from dsv4.serving.expert_metrics import ExpertSelectionCollector
from dsv4.serving.metrics import WorkerMetrics
from dsv4.transfer import TransportEndpoint
from dsv4.types import TransportKind, WorkerInfo, WorkerRole
from dsv4.worker.build import WorkerRuntime


@dataclass(frozen=True)
class WorkerIdentity:
    worker_id: str
    address: str  # host:port the router (and D, for Release) dials
    role: WorkerRole


@dataclass(frozen=True)
class WorkerLoad:
    """The service's own counters, on top of the engine's load."""

    num_running_requests: int
    num_queued_tokens: int
    num_leases: int
    is_draining: bool


def worker_info(runtime: WorkerRuntime, identity: WorkerIdentity, load: WorkerLoad) -> WorkerInfo:
    """Info's answer; cheap and safe from any thread (reads snapshots only)."""
    engine_load = runtime.engine.load()
    transport = runtime.transport
    return WorkerInfo(
        worker_id=identity.worker_id,
        role=identity.role,
        address=identity.address,
        transport_kind=TransportKind(transport.kind) if transport else TransportKind.LOCAL,
        transport_endpoint=transport.endpoint().peer_id if transport else "",
        layout=runtime.layout_info,
        num_free_blocks=engine_load.num_free_blocks,
        num_total_blocks=engine_load.num_total_blocks,
        num_queued_tokens=load.num_queued_tokens,
        num_running_requests=load.num_running_requests,
        num_leases=load.num_leases,
        is_draining=load.is_draining,
        model_name=runtime.config.model.path,
        vocab_size=runtime.model_config.vocab_size,
        max_model_len=runtime.config.model.max_model_len,
        updated_at_unix_ms=int(time.time() * 1000),
        speculative_method=runtime.config.speculative.method,
    )


def worker_record(info: WorkerInfo, endpoint_bytes: bytes) -> WorkerRecord:
    return WorkerRecord(
        role="prefill" if info.role is WorkerRole.PREFILL else "decode",
        worker_id=info.worker_id,
        address=info.address,
        transport_kind=info.transport_kind.value,
        transport_endpoint=endpoint_bytes,
        layout_hash=info.layout_hash,
        free_blocks=info.num_free_blocks,
        queued_prefill_tokens=info.num_queued_tokens,
        running_requests=info.num_running_requests,
        draining=info.is_draining,
    )


def public_endpoint(endpoint: TransportEndpoint) -> bytes:
    """The endpoint as published to the registry: identity and geometry, without the payload
    (NIXL agent metadata, CUDA IPC handles): that reaches D only in an authenticated Prefill
    answer, never anyone who can read Redis."""
    return dataclasses.replace(endpoint, payload=b"").to_bytes()


def start_heartbeat(
    config: ServeConfig, runtime: WorkerRuntime, make_info: Callable[[], WorkerInfo]
) -> tuple[WorkerHeartbeat, WorkerRegistry] | None:
    """With a Redis registry configured: start publishing; None for static discovery."""
    d = config.discovery
    if not d.redis_url:
        return None
    registry = make_registry(
        redis_url=d.redis_url, prefix=d.redis_key_prefix, ttl_s=d.ttl_s,
        secret=config.security.shared_secret,
    )  # fmt: skip
    endpoint = public_endpoint(runtime.transport.endpoint()) if runtime.transport else b""
    heartbeat = WorkerHeartbeat(
        registry, lambda: worker_record(make_info(), endpoint), interval_s=d.heartbeat_s
    )
    heartbeat.start()
    return heartbeat, registry


async def undrain(service: Any, context: Any) -> None:
    """Undrain RPC of either service: take new requests again, unless shutting down (SIGTERM
    set `service.is_stopping`; an operator's undrain must not undo a shutdown)."""
    if service.is_stopping:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"worker {service.identity.worker_id} is shutting down: it cannot be undrained",
        )
    service.is_draining = False


def worker_metrics(
    registry: CollectorRegistry,
    runtime: WorkerRuntime,
    identity: WorkerIdentity,
    *,
    num_running: Callable[[], int],
    is_draining: Callable[[], bool],
) -> WorkerMetrics:
    """The metrics every worker exports (dsv4.serving.metrics), wired to this runtime's engine;
    with `metrics.routing_stats` also the per-layer expert popularity."""
    stats = runtime.engine.core.runner.routing_stats
    if stats is not None:
        layers = runtime.model_config.num_hidden_layers
        registry.register(ExpertSelectionCollector(stats.snapshot, layers))
    return WorkerMetrics.create(
        registry,
        worker_id=identity.worker_id,
        role=identity.role.value,
        load=runtime.engine.load,
        num_running=num_running,
        is_draining=is_draining,
        index_cache_hit_ratio=lambda: index_cache_hit_ratio(runtime),
        step_counters=runtime.engine.core.step_counters,
        model_name=runtime.config.model.path,
        expert_stats=runtime.offload.stats if runtime.offload is not None else None,
        step_failures=lambda: runtime.engine.num_step_failures,
        hung_steps=lambda: runtime.engine.num_hung_steps,
    )


def index_cache_hit_ratio(runtime: WorkerRuntime) -> float:
    """The model runner's `index_cache_hit_ratio`: the share of ratio-4 layers whose top-k
    comes from the IndexCache, in [0, 1]."""
    return runtime.engine.core.runner.index_cache_hit_ratio


def mtp_counts(runtime: WorkerRuntime) -> tuple[int, int]:
    """(drafted, accepted) draft tokens so far from the runner's speculative decoder, or (0, 0)
    without one. Read at scrape time from another thread: plain int sums, no locking needed."""
    spec = getattr(runtime.engine.core.runner, "spec_metrics", None)
    if spec is None:
        return 0, 0
    return sum(spec.num_drafted), sum(spec.num_accepted)
