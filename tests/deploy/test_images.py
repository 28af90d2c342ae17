"""The images cannot be built here (no Docker engine), so their Dockerfiles are linted, and the
preStop drain script they ship is run against a fake worker."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from k8s_objects import DEPLOY, ROOT, find, main_container

from dsv4.rpc.v1 import worker_pb2, worker_pb2_grpc

DOCKER = DEPLOY / "docker"
IMAGES = {"worker": ("50061", "9400"), "router": ("50051", "9400")}
# top-level module -> the PyPI name the router Dockerfile installs
ROUTER_MODULE_PACKAGES = {
    "grpc": "grpcio",
    "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection",
    "google": "protobuf",
    "redis": "redis",
    "tokenizers": "tokenizers",
    "numpy": "numpy",
    "prometheus_client": "prometheus-client",
    "yaml": "pyyaml",
}
HEAVY = {"torch", "triton", "nixl", "flashinfer", "transformers", "safetensors"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") and not pending:
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            if word:
                out.append((word.upper(), rest.strip()))
            pending = ""
    return out


@pytest.mark.parametrize("image", IMAGES)
def test_dockerfile_lint(image):
    steps = instructions(DOCKER / f"{image}.Dockerfile")
    words = [w for w, _ in steps]
    for base in (args for w, args in steps if w == "FROM"):
        ref = base.split()[0]
        tag = ref.rsplit("/", 1)[-1].partition(":")[2]
        assert "@sha256:" in ref or (tag and tag != "latest"), f"unpinned base image {ref}"
    users = [args for w, args in steps if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must not run as root"
    assert "HEALTHCHECK" in words
    exposed = {p for w, args in steps if w == "EXPOSE" for p in args.split()}
    assert exposed == set(IMAGES[image])
    for word in ("ENTRYPOINT", "CMD"):
        (args,) = [a for w, a in steps if w == word]
        assert isinstance(json.loads(args), list), f"{word} must use the exec (JSON) form"
    for args in (a for w, a in steps if w == "COPY"):
        *sources, _ = args.split()
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"


def test_dockerignore_applies_to_both_dockerfiles():
    for image in IMAGES:
        ignore = DOCKER / f"{image}.Dockerfile.dockerignore"
        assert ignore.read_text() == (DOCKER / ".dockerignore").read_text()
    patterns = (DOCKER / ".dockerignore").read_text().split()
    assert ".git" in patterns and ".venv" in patterns


def test_worker_image_ships_the_prestop_drain_script(rendered):
    steps = instructions(DOCKER / "worker.Dockerfile")
    copies = [a.split() for w, a in steps if w == "COPY"]
    assert ["deploy/scripts/drain.py", "/opt/dsv4/drain.py"] in copies
    command = main_container(find(rendered["base"], "Deployment", "dsv4-prefill"))["lifecycle"]
    assert command["preStop"]["exec"]["command"][1] == "/opt/dsv4/drain.py"


def test_router_image_installs_what_the_router_imports():
    code = (
        "import sys, dsv4.cli, router_svc.server, loadgen.cli\n"
        "dsv4.cli.build_parser()  # the image runs `dsv4 router`: the whole CLI must load\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    imported = set(out.stdout.split())
    assert not imported & HEAVY, f"the router imports {imported & HEAVY}"
    text = (DOCKER / "router.Dockerfile").read_text()
    for module in sorted(imported & set(ROUTER_MODULE_PACKAGES)):
        assert f'"{ROUTER_MODULE_PACKAGES[module]}>=' in text, f"router image lacks {module}"


# ---- the preStop drain script against a fake worker ------------------------------------------


def _load_drain():
    spec = importlib.util.spec_from_file_location("dsv4_drain", DEPLOY / "scripts" / "drain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakePrefill(worker_pb2_grpc.PrefillWorkerServicer):
    """Busy for `busy_polls` Drain calls, then idle; checks the shared secret when given."""

    def __init__(self, busy_polls: int, secret: str = "") -> None:
        self.busy_polls, self.secret, self.calls = busy_polls, secret, 0

    def Drain(self, request, context):
        if self.secret and dict(context.invocation_metadata()).get("x-dsv4-token") != self.secret:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing token")
        self.calls += 1
        busy = self.calls <= self.busy_polls
        return worker_pb2.DrainResponse(num_running_requests=int(busy), num_leases=int(busy))


@pytest.fixture
def fake_worker():
    servers = []

    def start(servicer):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
        health_servicer = health.HealthServicer()
        health_servicer.set("dsv4.v1.PrefillWorker", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None)


def _clean_env(monkeypatch, **values):
    for name in [n for n in os.environ if n.startswith("DSV4_")]:
        monkeypatch.delenv(name)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


def test_drain_waits_until_idle(fake_worker, monkeypatch):
    _clean_env(monkeypatch, DSV4_SHARED_SECRET="s3cret")
    worker = FakePrefill(busy_polls=2, secret="s3cret")
    address = fake_worker(worker)
    drain = _load_drain()
    assert drain.main(["--address", address, "--timeout-s", "10", "--poll-s", "0.01"]) == 0
    assert worker.calls == 3


def test_drain_gives_up_at_its_timeout(fake_worker, monkeypatch):
    _clean_env(monkeypatch)
    address = fake_worker(FakePrefill(busy_polls=10**6))
    drain = _load_drain()
    assert drain.main(["--address", address, "--timeout-s", "0.3", "--poll-s", "0.05"]) == 1


def test_drain_without_the_secret_is_refused(fake_worker, monkeypatch):
    _clean_env(monkeypatch)
    address = fake_worker(FakePrefill(busy_polls=0, secret="s3cret"))
    assert _load_drain().main(["--address", address, "--timeout-s", "2"]) == 1


def test_drain_of_an_absent_worker_fails_fast(monkeypatch):
    _clean_env(monkeypatch)
    assert _load_drain().main(["--address", "127.0.0.1:1", "--timeout-s", "1"]) == 1
