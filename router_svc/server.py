"""The router process: a grpc.aio server with Router, grpc.health.v1 and reflection.

`serve(cfg)` builds a `RouterServer`; `await start()` probes the workers once, binds and
serves; `await stop(grace_s)` stops taking calls, lets running streams finish for `grace_s`,
then cancels them (their cleanup aborts D and releases P's leases), stops the pool's probes and
closes every channel. `main(argv)` is `dsv4 router`: it parses the ServeConfig once and runs
until SIGINT or SIGTERM.

Health: service "" is SERVING while the process is up (liveness); "dsv4.v1.Router" is SERVING
only while some request could be routed (readiness), updated after every probe round.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import os
import signal
import ssl
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dsv4.config import ServeConfig, add_config_args, config_from_args
from dsv4.discovery import WorkerRegistry, make_registry
from dsv4.errors import ConfigError, Dsv4Error
from dsv4.rpc.v1 import router_pb2, router_pb2_grpc
from dsv4.serving.logs import configure_logging
from dsv4.serving.metrics import MetricsExporter, RouterMetrics, new_registry
from dsv4.serving.ports import listen_failure
from dsv4.serving.rpc_guard import MalformedMessageInterceptor, require_shared_secret
from dsv4.serving.tasks import TaskOwner
from dsv4.types import WorkerRole
from router_svc.admission import AdmissionGate, TokenBucketLimiter
from router_svc.clients import ClientSettings, WorkerClients
from router_svc.flow_settings import FlowDeps, FlowSettings
from router_svc.http import HttpFront, load_chat_template
from router_svc.intake import TokenizerPool
from router_svc.live import LiveRequests
from router_svc.pool import PoolSettings, WorkerPool
from router_svc.servicer import RouterServicer
from router_svc.text_model import TextModel, load_text_model
from router_svc.view import PoolSnapshot, WorkerHealth

logger = logging.getLogger(__name__)

ROUTER_SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_STOP_WAIT_S = 2.0  # after the server stopped: how long cancelled handlers get to clean up


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # docs/architecture.md#platform-notes: the default cancels calls beyond ~1000 in flight.
        ("grpc.server.max_pending_requests", 10_000),
        ("grpc.server.max_pending_requests_hard_limit", 20_000),
        ("grpc.so_reuseport", 0),  # a second router on the same port must fail, not share
    ]


def _read_pem(field: str, flag: str, path: str, marker: bytes, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(field, path, f"cannot read it ({exc.strerror})", flag=flag) from None
    if marker not in data:
        raise ConfigError(field, path, f"not a PEM {what}: give the {what} file", flag=flag)
    return data


def check_tls_files(cfg: ServeConfig) -> None:
    """The TLS files must load before the port is bound: gRPC's C core only fails the bind,
    which read as a port already taken. Raises ConfigError naming the flag."""
    s = cfg.security
    cert_field, key_field = "security.tls_cert_path", "security.tls_key_path"
    if s.tls_ca_path:
        _read_pem("security.tls_ca_path", "--tls-ca", s.tls_ca_path,
                  b"-----BEGIN CERTIFICATE-----", "CA certificate")  # fmt: skip
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=s.tls_ca_path)
        except (ssl.SSLError, ValueError):
            fix = "a PEM certificate that does not parse: give the CA certificate file"
            raise ConfigError("security.tls_ca_path", s.tls_ca_path, fix, flag="--tls-ca") from None
    if not s.tls_cert_path:
        return
    _read_pem(cert_field, "--tls-cert", s.tls_cert_path, b"-----BEGIN CERTIFICATE-----",
              "certificate")  # fmt: skip
    key = _read_pem(key_field, "--tls-key", s.tls_key_path, b"PRIVATE KEY-----", "private key")
    if b"ENCRYPTED" in key:
        fix = "an encrypted key: give it unencrypted (openssl pkey -in KEY -out PLAIN.pem)"
        raise ConfigError(key_field, s.tls_key_path, fix, flag="--tls-key")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=s.tls_cert_path)
    except (ssl.SSLError, ValueError):
        fix = "a PEM certificate that does not parse: give the server's certificate file"
        raise ConfigError(cert_field, s.tls_cert_path, fix, flag="--tls-cert") from None
    try:  # the password callback: an encrypted key fails here instead of prompting
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(
            s.tls_cert_path, s.tls_key_path, password=lambda: b""
        )
    except ssl.SSLError as exc:
        fix = (
            f"does not match the certificate {s.tls_cert_path}: give the key it was issued for"
            if exc.reason == "KEY_VALUES_MISMATCH"
            else "a PEM private key that does not parse: give the server's private key file"
        )
        raise ConfigError(key_field, s.tls_key_path, fix, flag="--tls-key") from None


def registry_from_config(cfg: ServeConfig) -> WorkerRegistry:
    d = cfg.discovery
    if d.redis_url:
        return make_registry(redis_url=d.redis_url, prefix=d.redis_key_prefix, ttl_s=d.ttl_s,  # type: ignore[arg-type]
                             secret=cfg.security.shared_secret)  # fmt: skip
    if not d.prefill_addresses and not d.decode_addresses:
        logger.warning("router: no workers configured: pass --prefill/--decode or --redis")
    return make_registry(prefill=",".join(d.prefill_addresses), decode=",".join(d.decode_addresses))


class RouterServer:
    """One router; create it with `serve(cfg)`, then `await start()` inside the event loop."""

    def __init__(
        self,
        cfg: ServeConfig,
        *,
        registry: WorkerRegistry | None = None,
        pool_settings: PoolSettings | None = None,
        text_model: TextModel | None = None,
    ) -> None:
        self._cfg = cfg
        self._registry = registry if registry is not None else registry_from_config(cfg)
        self._clients = WorkerClients(ClientSettings.from_config(cfg))
        self.live = LiveRequests()
        self.cleanup = TaskOwner("router cleanup")
        self.pool = WorkerPool(
            self._registry,
            self._clients,
            pool_settings or PoolSettings.from_config(cfg),
            on_down=self.live.fail_worker,
            on_round=self._update_health,
        )
        text = text_model if text_model is not None else load_text_model(cfg.model)
        logger.info("router: tokenizer %s", text.source)
        self.registry = new_registry()
        self.metrics = RouterMetrics.create(self.registry, model_name=cfg.model.path)
        deps = FlowDeps(
            self.pool, self._clients, FlowSettings.from_config(cfg), text, self.cleanup,
            self.metrics,
        )  # fmt: skip
        r = cfg.router
        self.gate = AdmissionGate(r.max_inflight_requests)
        self.metrics.in_flight.set_function(lambda: self.gate.num_inflight)
        self._exporter = MetricsExporter(
            self.registry, r.host, cfg.metrics.prometheus_port, role="router"
        )
        limiter = TokenBucketLimiter(r.rate_limit_rps, r.rate_limit_burst)
        self.tokenizer_pool = TokenizerPool(text.encode)
        self.servicer = RouterServicer(
            cfg, deps, self.live, self.gate, limiter, self.tokenizer_pool
        )
        self.http: HttpFront | None = None  # the OpenAI-compatible front (router.http_port)
        if r.http_port:
            chat = load_chat_template(cfg.model, text)
            self.http = HttpFront(
                cfg, self.servicer, self.pool, self.metrics, self.registry, text, chat
            )
        self._health: health.aio.HealthServicer | None = None
        self._server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self._cfg.router.host}:{self.port}"

    async def start(self) -> None:
        """Probe the workers once, bind and serve. Raises Unavailable when the port is taken."""
        server = grpc.aio.server(
            interceptors=[MalformedMessageInterceptor()],
            options=server_options(self._cfg.router.max_message_bytes),
        )
        self._health = health.aio.HealthServicer()
        router_pb2_grpc.add_RouterServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = (ROUTER_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        r = self._cfg.router
        try:
            self.port = self._bind(server, f"{r.host}:{r.port}")
        except RuntimeError as exc:
            raise listen_failure(r.host, r.port, "serve the router's gRPC", "pick a free --port",
                                 str(exc)) from exc  # fmt: skip
        await self._health.set(ROUTER_SERVICE_NAME, _NOT_SERVING)
        await self.pool.start()
        await server.start()
        self._server = server
        self._exporter.start()
        if self.http is not None:
            await self.http.start()
        http = f"; OpenAI-compatible HTTP on {self.http.url}" if self.http else ""
        logger.info("router: serving dsv4.v1.Router on %s%s", self.address, http)

    def _bind(self, server: grpc.aio.Server, bind: str) -> int:
        s = self._cfg.security
        if not s.tls_cert_path:
            return server.add_insecure_port(bind)
        pair = (Path(s.tls_key_path).read_bytes(), Path(s.tls_cert_path).read_bytes())
        credentials = grpc.ssl_server_credentials([pair])
        return server.add_secure_port(bind, credentials)

    async def _update_health(self, snapshot: PoolSnapshot) -> None:
        counts = collections.Counter((w.role, w.health) for w in snapshot.workers)
        for role in WorkerRole:
            for state in WorkerHealth:
                gauge = self.metrics.workers.labels(role=role.value, health=state.value)
                gauge.set(counts[(role, state)])
        if self._health is not None:
            await self._health.set(
                ROUTER_SERVICE_NAME, _SERVING if snapshot.has_route else _NOT_SERVING
            )

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Graceful stop; idempotent. Running streams get `grace_s`, then are cancelled."""
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        http_stop = asyncio.create_task(self.http.stop()) if self.http else None  # meanwhile
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if http_stop is not None:
            await http_stop
        deadline_s = time.monotonic() + _STOP_WAIT_S
        while len(self.live) and time.monotonic() < deadline_s:
            await asyncio.sleep(0.01)  # cancelled handlers run their cleanup
        await self.pool.stop()
        await self.cleanup.close(timeout_s=_STOP_WAIT_S)
        await self._clients.close()
        self.tokenizer_pool.close()
        self._registry.close()
        self._exporter.stop()

    def find_leaks(self) -> list[str]:
        leaks = self.live.find_leaks() + self.cleanup.find_leaks()
        if self.gate.num_inflight:
            leaks.append(f"{self.gate.num_inflight} admission slots still taken")
        return leaks


def serve(cfg: ServeConfig, **overrides: object) -> RouterServer:
    """A RouterServer for `cfg` (not started). `overrides`: RouterServer's keyword arguments."""
    return RouterServer(cfg, **overrides)  # type: ignore[arg-type]


async def _run_until_signal(cfg: ServeConfig) -> int:
    server = serve(cfg)
    stop_event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_event.set)
    try:
        await server.start()
        await stop_event.wait()
        logger.info("router: stopping (grace %.0f s)", cfg.worker.drain_timeout_s)
    finally:
        await server.stop(cfg.worker.drain_timeout_s)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`dsv4 router [flags]`: serve until SIGINT/SIGTERM; 2 on a config error, 1 on failure."""
    parser = argparse.ArgumentParser(
        prog="dsv4 router", description="dsv4 router (public gRPC API)"
    )
    add_config_args(parser)
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args, os.environ)
        require_shared_secret(cfg)
        check_tls_files(cfg)
    except ConfigError as exc:
        parser.exit(2, f"dsv4 router: {exc}\n")
    r = cfg.router
    configure_logging(cfg.metrics.log_level, cfg.metrics.log_format, f"router-{r.host}:{r.port}")
    try:
        return asyncio.run(_run_until_signal(cfg))
    except Dsv4Error as exc:
        logger.error("router: %s", exc)
        return getattr(exc, "exit_code", 1)  # PortInUse's: a launcher may start it again
