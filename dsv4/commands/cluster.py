"""`dsv4 up` and `dsv4 demo`: a local cluster of real processes (router + N prefill + M decode).

`LocalCluster` starts each service as `python -m dsv4.commands.cli <role> ...` in its own session (so a
terminal Ctrl-C reaches the launcher, which then stops the services in order: router first,
then workers), logs each to `<log_dir>/<name>.log`, waits until every one answers
grpc.health.v1 SERVING, and `stop()`s them: SIGTERM, then SIGKILL after `grace_s`. On Linux
the children also get SIGTERM if the launcher itself dies (PR_SET_PDEATHSIG), so a killed test
run leaves nothing behind. Discovery is the static --prefill/--decode lists unless `--redis`.
`--model tiny` writes the deterministic tiny checkpoint once into the cache dir (every process
then loads the same bytes; `dsv4.commands.tiny_checkpoint`). Flags `dsv4 up` does not know are
passed to every service (for example `--num-blocks 64`); `dsv4.commands.service_args` reads
them as the services will.

With a `placement` (`dsv4 up --gpus`, `dsv4.commands.placement`) each worker process gets its
own cards as CUDA_VISIBLE_DEVICES (the launcher's entries at those indices); without one every
service inherits the launcher's.

Worker RPCs always need the shared secret. The one configured (`--shared-secret`, env
DSV4_SHARED_SECRET or the YAML) is used, else a fresh `secrets.token_urlsafe(32)`; either way
it reaches the services in their environment (DSV4_SHARED_SECRET), never on a command line
where `ps` shows it, and a generated one is also written to a 0600 file (`secret_path`) for
the operator's tools (deploy/scripts/drain.py), removed at `stop()`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from dsv4.commands.placement import CUDA_VISIBLE, Placement, visible_devices
from dsv4.commands.service_args import channel_credentials, configured_secret, split_secret
from dsv4.errors import PortInUse, Unavailable
from dsv4.serving.ports import bind_problem, free_port, owns_listener, reserve_port

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dsv4"
HEALTH_POLL_INTERVAL_S = 0.2
START_TRIES = 3  # starts of a cluster whose picked ports other processes took first
AUTO_PORTS = -1
ROUTER_HEALTH_NAME = "dsv4.v1.Router"  # SERVING once some request can be routed (readiness)
SECRET_ENV = "DSV4_SHARED_SECRET"  # the env twin of --shared-secret
# How `dsv4.commands.cli.main` starts a service's one error line: "dsv4 prefill: error: ..."
_ERROR_LINE = re.compile(r"^dsv4 [\w-]+: (?:error: )?")


@dataclass(frozen=True)
class ClusterSpec:
    model_dir: str
    host: str = "127.0.0.1"
    router_port: int = 50051
    num_prefill: int = 1
    num_decode: int = 1
    redis_url: str = ""
    service_args: tuple[str, ...] = ()  # passed to every service
    prefill_args: tuple[str, ...] = ()  # then to prefill workers only (--tensor-parallel-size 2)
    decode_args: tuple[str, ...] = ()  # then to decode workers only
    log_dir: str = ""  # empty: a temporary directory
    grace_s: float = 10.0
    with_router: bool = True  # False: workers only (worker tests call them directly)
    # Prometheus: 0 off; N: router on N, then each worker on the next port; AUTO_PORTS (the
    # default): a free port per service, printed by `dsv4 up`.
    metrics_base_port: int = AUTO_PORTS
    http_port: int = 0  # the router's OpenAI-compatible HTTP port; 0: off
    placement: Placement | None = None  # each worker's cards (--gpus); None: inherited
    ready_timeout_s: float = 120.0  # `start()`'s wait for every service to be SERVING

    def fixed_ports(self) -> list[int]:
        """The ports the launcher gives services itself (router, HTTP, set metrics ports);
        the others are `free_port`s."""
        ports = [self.router_port] if self.with_router else []
        ports += [self.http_port] if self.http_port and self.with_router else []
        if self.metrics_base_port > 0:
            workers = self.num_prefill + self.num_decode
            ports += [self.metrics_base_port + i for i in range(workers + 1)]
        return ports


@dataclass
class _Service:
    name: str
    role: str
    address: str
    process: subprocess.Popen[bytes]
    log_path: Path
    metrics_port: int = 0  # 0: no /metrics

    @property
    def metrics_url(self) -> str:
        return f"http://{self.address.rpartition(':')[0]}:{self.metrics_port}/metrics"

    def log_tail(self, num_lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        return ""


class StartFailed(Unavailable):
    """A service did not come up: it exited (`exit_code`; 2 for a user error, as `dsv4`
    exits), another process answers on its port (`foreign`), or it was not SERVING in time
    (`exit_code` None). `reason`: one line, the service's own error line where it wrote one;
    the message adds the log tail."""

    def __init__(self, service: _Service, what: str, *, exit_code: int | None = None,
                 foreign: bool = False) -> None:  # fmt: skip
        tail = service.log_tail()
        super().__init__(f"{service.name} {what}:\n{tail}")
        self.service_name, self.role, self.what = service.name, service.role, what
        self.exit_code, self.foreign = exit_code, foreign
        self.reason = error_line(tail) if exit_code is not None else ""


def error_line(log_text: str) -> str:
    """A service's own one-line error (`dsv4 ROLE: error: ...` without that prefix), else
    the log's last line."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    for line in reversed(lines):
        if found := _ERROR_LINE.match(line):
            return line[found.end() :]
    return lines[-1] if lines else ""


@dataclass
class LocalCluster:
    spec: ClusterSpec
    services: list[_Service] = field(default_factory=list)
    _tmp: tempfile.TemporaryDirectory[str] | None = None
    log_dir: Path | None = None  # where `<name>.log` go, once started
    credentials: object = None  # grpc.ChannelCredentials matching the services (None: plaintext)
    shared_secret: str = field(default="", repr=False)  # every worker RPC carries it
    secret_path: str = ""  # a generated secret's 0600 file ("" when it was configured)
    _secret_dir: tempfile.TemporaryDirectory[str] | None = None
    _env: dict[str, str] = field(default_factory=dict, repr=False)  # the services' environment

    @property
    def worker_metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata that authenticates a call to any worker of this cluster."""
        from dsv4.worker.server import TOKEN_METADATA_KEY

        return ((TOKEN_METADATA_KEY, self.shared_secret),)

    @property
    def router_address(self) -> str:
        return f"{self.spec.host}:{self.spec.router_port}"

    @property
    def http_url(self) -> str:
        """Base URL of the router's OpenAI-compatible API ("" when off)."""
        return f"http://{self.spec.host}:{self.spec.http_port}/v1" if self.spec.http_port else ""

    def addresses(self, role: str) -> list[str]:
        return [s.address for s in self.services if s.role == role]

    def service(self, name: str) -> _Service:
        return next(s for s in self.services if s.name == name)

    def metrics_urls(self) -> dict[str, str]:
        """Service name -> its /metrics URL (services with metrics on)."""
        return {s.name: s.metrics_url for s in self.services if s.metrics_port}

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, ready_timeout_s: float | None = None) -> None:
        """Start every service and wait until all are SERVING (`ready_timeout_s`, default the
        spec's); raises `StartFailed` (with the failing service's log tail) after stopping
        whatever started. A service that found a port the launcher picked taken (`PortInUse`:
        another process bound it between the pick and the service's bind) costs one more start
        on fresh ports, up to START_TRIES; a port the spec fixed is the user's to free."""
        for attempt in range(1, START_TRIES + 1):
            try:
                return self._start_once(ready_timeout_s)
            except StartFailed as exc:
                if (
                    exc.exit_code != PortInUse.exit_code
                    or attempt == START_TRIES
                    or any(bind_problem(self.spec.host, p) for p in self.spec.fixed_ports())
                ):
                    raise
                logger.warning("%s: %s; starting again on fresh ports (try %d of %d)",
                               exc.service_name, exc.reason, attempt + 1, START_TRIES)  # fmt: skip

    def _start_once(self, ready_timeout_s: float | None) -> None:
        spec = self.spec
        if ready_timeout_s is None:
            ready_timeout_s = spec.ready_timeout_s
        for port in spec.fixed_ports():
            reserve_port(port)  # no worker gets the router's port from `free_port`
        if spec.log_dir:
            log_dir = Path(spec.log_dir)
            log_dir.mkdir(parents=True, exist_ok=True)
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="dsv4-cluster-")
            log_dir = Path(self._tmp.name)
        self.log_dir = log_dir
        common = [
            "--model",
            spec.model_dir,
            *(["--redis", spec.redis_url] if spec.redis_url else []),
        ]
        service_args, given_secret = split_secret(spec.service_args)
        self.credentials = channel_credentials(service_args)
        try:
            self._set_secret(given_secret or configured_secret(service_args))
            for role, count in (("prefill", spec.num_prefill), ("decode", spec.num_decode)):
                for i in range(count):
                    port = free_port(spec.host)
                    args = [*common, "--worker-host", spec.host, "--worker-port", str(port)]
                    args += ["--worker-id", f"{role}-{i}", *service_args]
                    args += spec.prefill_args if role == "prefill" else spec.decode_args
                    self._spawn(f"{role}-{i}", role, f"{spec.host}:{port}", args, log_dir)
            if not spec.with_router:
                self.wait_ready(ready_timeout_s)
                return
            router_args = [*common, "--host", spec.host, "--port", str(spec.router_port)]
            if spec.http_port:
                router_args += ["--http-port", str(spec.http_port)]
            if not spec.redis_url:
                for role in ("prefill", "decode"):
                    router_args += [f"--{role}", ",".join(self.addresses(role))]
            self._spawn(
                "router", "router", self.router_address, [*router_args, *service_args], log_dir
            )
            self.wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _set_secret(self, configured: str) -> None:
        """The services' shared secret: the configured one, else a fresh one in a 0600 file."""
        self.shared_secret = configured or secrets.token_urlsafe(32)
        self._env = {**os.environ, SECRET_ENV: self.shared_secret}
        if configured:
            return
        self._secret_dir = tempfile.TemporaryDirectory(prefix="dsv4-secret-")  # mode 0700
        path = Path(self._secret_dir.name) / "shared_secret"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(self.shared_secret + "\n")
        self.secret_path = str(path)

    def _spawn(self, name: str, role: str, address: str, args: list[str], log_dir: Path) -> None:
        log_path = log_dir / f"{name}.log"
        metrics_port = self._metrics_port(len(self.services), role)
        args = [*args, "--metrics-port", str(metrics_port)]  # 0 too: not the role's default
        command = [
            sys.executable,
            "-m",
            "dsv4.commands.cli",
            "--parent-pid",
            str(os.getpid()),
            role,
            *args,
        ]
        env = self._service_env(name)
        logger.info("starting %s: %s", name, " ".join(command))
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env=env,
            )  # fmt: skip
        self.services.append(_Service(name, role, address, process, log_path, metrics_port))

    def _service_env(self, name: str) -> dict[str, str] | None:
        """The service's environment: the cluster's, and a placed worker's own cards."""
        cards = self.spec.placement.cards_of(name) if self.spec.placement else ()
        if not cards:
            return self._env or None
        env = self._env or dict(os.environ)
        return {**env, CUDA_VISIBLE: visible_devices(cards, env.get(CUDA_VISIBLE))}

    def _metrics_port(self, index: int, role: str) -> int:
        base = self.spec.metrics_base_port
        if base == AUTO_PORTS:
            return free_port(self.spec.host)
        if base <= 0:
            return 0
        return base if role == "router" else base + 1 + index  # workers start first

    def wait_ready(self, timeout_s: float, services: list[_Service] | None = None) -> None:
        """Poll grpc.health.v1 of each service until SERVING; a service that exits, or whose
        port another process answers on, fails (`StartFailed`)."""
        give_up_s = time.monotonic() + timeout_s
        for service in services or self.services:
            health_name = ROUTER_HEALTH_NAME if service.role == "router" else ""
            while True:
                serving = is_serving(service.address, health_name, credentials=self.credentials)
                if service.process.poll() is not None:  # after the check: who answered?
                    code = service.process.returncode
                    raise StartFailed(service, f"exited with {code} during start-up",
                                      exit_code=code)  # fmt: skip
                if serving:
                    _check_own(service)
                    break
                if time.monotonic() > give_up_s:
                    raise StartFailed(service, f"not SERVING after {timeout_s:g} s")
                time.sleep(HEALTH_POLL_INTERVAL_S)

    def dead_services(self) -> list[_Service]:
        return [s for s in self.services if s.process.poll() is not None]

    def stop(self) -> None:
        """Router first, then workers: SIGTERM, then SIGKILL after `grace_s`. Idempotent."""
        routers = [s for s in self.services if s.role == "router"]
        workers = [s for s in self.services if s.role != "router"]
        for group in (routers, workers):
            for service in group:
                terminate(service.process, signal.SIGTERM)
            give_up_s = time.monotonic() + self.spec.grace_s
            for service in group:
                try:
                    service.process.wait(timeout=max(0.0, give_up_s - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning(
                        "%s did not stop in %.0f s: killing it", service.name, self.spec.grace_s
                    )
                    terminate(service.process, signal.SIGKILL)
                    service.process.wait(timeout=10)
        self.services.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        if self._secret_dir is not None:
            self._secret_dir.cleanup()
            self._secret_dir, self.secret_path = None, ""


def _check_own(service: _Service) -> None:
    """The server that answered on the service's port is the service (not one that held the
    port before it started, which it then fails to bind)."""
    port = int(service.address.rpartition(":")[2])
    if owns_listener(service.process.pid, port) is False:
        raise StartFailed(service, f"did not start: another process answers on {service.address}",
                          foreign=True)  # fmt: skip


def terminate(process: subprocess.Popen[bytes], sig: int) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)


def is_serving(
    address: str, service_name: str = "", timeout_s: float = 1.0, *, credentials: object = None
) -> bool:
    """grpc.health.v1 says SERVING for `service_name` ("" = the process); `credentials`:
    grpc.ChannelCredentials for a TLS port (see `service_args.channel_credentials`)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if credentials is not None:
        channel = grpc.secure_channel(address, credentials)  # type: ignore[arg-type]
    else:
        channel = grpc.insecure_channel(address)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service_name), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
