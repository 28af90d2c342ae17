"""A worker process from start to exit: `run_worker(config)` (behind `dsv4 prefill|decode`).

Start: build the runtime (model, engine, transport) -> bind the gRPC server (health, reflection,
auth) -> start engine, service and server -> health SERVING -> heartbeat (with Redis).
With `metrics.routing_stats_out` an owned task dumps the routing stats every interval (and once
more after the engine stops). SIGTERM / SIGINT: drain (take nothing new, health NOT_SERVING; wait
up to `worker.drain_timeout_s` for running requests and leases to finish) -> withdraw from discovery
-> stop the server -> stop the service (ends leases, cancels owned tasks) -> stop the engine ->
stop the follower ranks -> close the transport. Returns the exit status: 1 when a follower
rank exited first (`watch_ranks`: the worker cannot step without it).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time

import torch

from dsv4.config import ServeConfig
from dsv4.errors import ConfigError
from dsv4.serving.logs import set_worker_id
from dsv4.serving.metrics import MetricsExporter
from dsv4.serving.rpc_guard import require_shared_secret
from dsv4.types import WorkerRole
from dsv4.worker import routing_dump
from dsv4.worker.build import build_worker_runtime
from dsv4.worker.identity import WorkerIdentity, start_heartbeat
from dsv4.worker.server import bind_port, follow_engine_health, make_server, set_serving

logger = logging.getLogger(__name__)

DRAIN_POLL_INTERVAL_S = 0.1
SERVER_STOP_GRACE_S = 1.0
RANK_POLL_INTERVAL_S = 0.2


def run_worker(config: ServeConfig) -> int:
    """Serve until SIGTERM/SIGINT; `config.worker.role` picks prefill or decode/colocated."""
    require_shared_secret(config)
    if not config.model.device.startswith("cuda"):
        torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    if config.worker.gil_switch_interval_ms > 0:
        sys.setswitchinterval(config.worker.gil_switch_interval_ms / 1e3)
    return asyncio.run(_serve(config))


def _service_class(role: WorkerRole):
    if role is WorkerRole.PREFILL:
        from prefill_svc.servicer import PrefillService

        return PrefillService
    from decode_svc.servicer import DecodeService

    return DecodeService


async def _serve(config: ServeConfig) -> int:
    if config.transfer.transport == "local":
        raise ConfigError(
            "transfer.transport",
            "local",
            "local moves KV only inside one process: use auto or nixl",
        )
    runtime = build_worker_runtime(config, name=config.worker.role)
    config = runtime.config
    w = config.worker
    role = WorkerRole(w.role)
    service_class = _service_class(role)
    service_name = service_class.SERVICE_NAME
    server, health = make_server(config, (service_name,))
    port = bind_port(server, config, w.host, w.port)
    identity = WorkerIdentity(w.worker_id, w.advertise_address or f"{w.host}:{port}", role)
    set_worker_id(identity.worker_id)
    service = service_class(runtime, identity)
    service.add_to_server(server)
    exporter = MetricsExporter(
        service.registry, w.host, config.metrics.prometheus_port, role=w.role
    )
    exporter.start()
    runtime.engine.start()
    await service.start()
    await server.start()
    await set_serving(health, (service_name,), True)
    ranks = runtime.ranks  # a RankGroup with tensor_parallel_size > 1, else None
    health_task = asyncio.create_task(
        follow_engine_health(
            health, (service_name,),
            lambda: runtime.engine.can_step and (ranks is None or ranks.all_alive),
        )
    )  # fmt: skip
    beating = start_heartbeat(config, runtime, service.info)
    dumps = routing_dump.start_dumps(runtime)  # None unless metrics.routing_stats_out
    logger.info("%s %s serving on %s", w.role, w.worker_id, identity.address)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    rank_lost = asyncio.Event()
    watch_task = None
    if ranks is not None:
        watch_task = asyncio.create_task(watch_ranks(ranks, service, stop, rank_lost))
    await stop.wait()

    logger.info("%s %s: draining", w.role, w.worker_id)
    service.is_stopping = True  # before is_draining: an Undrain now is refused
    service.is_draining = True
    owned = [t for t in (health_task, watch_task, dumps) if t is not None]
    for task in owned:
        task.cancel()
    await asyncio.gather(*owned, return_exceptions=True)
    await set_serving(health, (service_name,), False)
    give_up_s = time.monotonic() + w.drain_timeout_s
    while not service.drain_status().is_idle and time.monotonic() < give_up_s:
        await asyncio.sleep(DRAIN_POLL_INTERVAL_S)
    if beating is not None:
        heartbeat, registry = beating
        await asyncio.to_thread(heartbeat.stop, withdraw=True, worker_id=w.worker_id)
        registry.close()
    await server.stop(SERVER_STOP_GRACE_S)
    await service.stop()
    await runtime.engine.stop()
    await asyncio.to_thread(routing_dump.dump_routing_stats, runtime)  # the last steps too
    if ranks is not None:
        await asyncio.to_thread(ranks.close)
    if runtime.transport is not None:
        runtime.transport.close()
    exporter.stop()
    logger.info("%s %s: stopped", w.role, w.worker_id)
    return 1 if rank_lost.is_set() else 0


async def watch_ranks(ranks, service, stop: asyncio.Event, rank_lost: asyncio.Event) -> None:
    """A follower rank that exits takes the worker down: Info says draining at once (the
    router stops routing here), health turns NOT_SERVING, and the worker stops (exit 1)."""
    while not (dead := ranks.dead_ranks()):
        await asyncio.sleep(RANK_POLL_INTERVAL_S)
    logger.error("rank(s) %s of this worker exited (rank, status): stopping the worker", dead)
    service.is_draining = True
    rank_lost.set()
    stop.set()
