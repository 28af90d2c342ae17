"""The grpc.aio server every worker (and tests) start: limits, health, reflection, TLS, auth.

`make_server(config, service_names)` returns an unstarted `grpc.aio.Server` plus its health
servicer; the caller adds its servicer, binds with `bind_port`, starts, and at shutdown awaits
`server.stop(grace)` (docs/architecture.md#platform-notes). Called once per process on the event
loop.

- Pending-request limits are raised (grpc-core otherwise CANCELs calls beyond ~1000 in flight).
- Message size limits are `router.max_message_bytes` both ways.
- `security.shared_secret` is always set (a worker refuses to start without it): every call except health checks and reflection must carry
  metadata `x-dsv4-token: <secret>`; others end UNAUTHENTICATED. Health stays open so
  Kubernetes probes work without the secret.
- With `security.tls_cert_path`, the port is TLS (mutual when `require_client_cert`).
- A request that does not parse ends INVALID_ARGUMENT (`dsv4.serving.rpc_guard`), never UNKNOWN.
- Health follows the engine (`follow_engine_health`): NOT_SERVING while the engine cannot
  step (thread gone, a step hung past `scheduler.step_timeout_s`, or its last steps all failed),
  so liveness restarts a worker stuck so.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dsv4.config import ServeConfig
from dsv4.errors import to_grpc_status
from dsv4.serving.ports import listen_failure
from dsv4.serving.rpc_guard import MalformedMessageInterceptor

logger = logging.getLogger(__name__)

TOKEN_METADATA_KEY = "x-dsv4-token"
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class SharedSecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the right `x-dsv4-token` (constant-time compare)."""

    def __init__(self, secret: str) -> None:
        self._secret = secret.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(_OPEN_PREFIXES):
            return await continuation(details)
        sent = dict(details.invocation_metadata or ()).get(TOKEN_METADATA_KEY, "")
        sent_bytes = sent.encode() if isinstance(sent, str) else bytes(sent)
        if hmac.compare_digest(sent_bytes, self._secret):
            return await continuation(details)
        handler = await continuation(details)
        return _refusing_handler(handler, details.method)


def _refusing_handler(handler: grpc.RpcMethodHandler | None, method: str) -> grpc.RpcMethodHandler:
    message = (
        f"{method}: missing or wrong {TOKEN_METADATA_KEY} metadata: send the worker's "
        "security.shared_secret"
    )

    async def refuse_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    deserialize = handler.request_deserializer if handler else None
    serialize = handler.response_serializer if handler else None
    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, deserialize, serialize)
    return grpc.unary_unary_rpc_method_handler(refuse_unary, deserialize, serialize)


def server_options(config: ServeConfig) -> list[tuple[str, int]]:
    size = config.router.max_message_bytes
    return [
        ("grpc.max_send_message_length", size),
        ("grpc.max_receive_message_length", size),
        ("grpc.server.max_pending_requests", 10000),
        ("grpc.server.max_pending_requests_hard_limit", 20000),
        ("grpc.so_reuseport", 0),
    ]


def make_server(
    config: ServeConfig, service_names: Sequence[str]
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """An unstarted server with health (every name SERVING once `set_serving` is called) and
    reflection for `service_names` (full names, e.g. "dsv4.v1.PrefillWorker")."""
    interceptors: list[grpc.aio.ServerInterceptor] = [MalformedMessageInterceptor()]
    if config.security.shared_secret:
        interceptors.append(SharedSecretInterceptor(config.security.shared_secret))
    server = grpc.aio.server(interceptors=interceptors, options=server_options(config))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    return server, health_servicer


def bind_port(server: grpc.aio.Server, config: ServeConfig, host: str, port: int) -> int:
    """Bind host:port (port 0: a free one), TLS when configured; returns the bound port."""
    address = f"{host}:{port}"
    s = config.security
    detail = "the bind failed"
    try:
        if s.tls_cert_path:
            credentials = grpc.ssl_server_credentials(
                [(Path(s.tls_key_path).read_bytes(), Path(s.tls_cert_path).read_bytes())],
                root_certificates=Path(s.tls_ca_path).read_bytes() if s.tls_ca_path else None,
                require_client_auth=s.require_client_cert,
            )
            bound = server.add_secure_port(address, credentials)
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio raises where older versions returned 0
        detail, bound = str(exc), 0
    if not bound:
        raise listen_failure(host, port, "serve gRPC", "pick a free worker.port (--worker-port)",
                             detail)  # fmt: skip
    return bound


async def set_serving(
    health_servicer: health.aio.HealthServicer, service_names: Sequence[str], is_serving: bool
) -> None:
    """Flip the overall ("") and per-service health status."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if is_serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", *service_names):
        await health_servicer.set(name, status)


async def follow_engine_health(
    health_servicer: health.aio.HealthServicer,
    service_names: Sequence[str],
    can_serve: Callable[[], bool],
    interval_s: float = 0.25,
) -> None:
    """Keep health SERVING exactly while `can_serve()` (the engine can step); runs until
    cancelled (the worker's main task owns it and cancels it before a drain's NOT_SERVING).
    A worker whose engine thread died, whose step hangs or whose steps keep failing says
    NOT_SERVING, so readiness stops traffic and liveness restarts it if it stays so."""
    serving: bool | None = None
    while True:
        now = can_serve()
        if now != serving:
            if serving is not None:
                logger.warning("health: %s", "SERVING" if now else "NOT_SERVING (engine)")
            await set_serving(health_servicer, service_names, now)
            serving = now
        await asyncio.sleep(interval_s)


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the call with the status `dsv4.errors.to_grpc_status` maps `exc` to (raises)."""
    code, message = to_grpc_status(exc)
    if code is grpc.StatusCode.INTERNAL:
        logger.error("internal error: %s", message, exc_info=exc)
    await context.abort(code, message)
