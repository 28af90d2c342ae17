"""The images cannot be built here (no Docker engine), so their Dockerfiles are linted, and the
preStop drain script they ship is run against a fake worker."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from k8s_objects import DEPLOY, ROOT, find, main_container

from dsv4.rpc.v1 import worker_pb2, worker_pb2_grpc

DOCKER = DEPLOY / "docker"
IMAGES = {"worker": ("50061", "9400"), "router": ("50051", "9400")}


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


def test_images_install_the_package_extras_not_hand_copied_lists():
    """The router image installs `.[router]` (the torch-free base set, which
    tests/unit/test_packaging.py checks against the router's imports); the worker `.[worker]`."""
    for image, extras in (("router", "router"), ("worker", "worker,gpu")):
        installs = [a for w, a in instructions(DOCKER / f"{image}.Dockerfile") if w == "RUN"]
        installs = [a for a in installs if "pip install" in a]
        assert any(f'pip install ".[{extras}]"' in a for a in installs), image
        pinned = [a for a in installs if re.search(r'"[a-z][\w.-]*[<>=]=?\d', a)]
        assert not [a for a in pinned if "torch==" not in a], f"{image}: a hand-copied list"


def test_images_check_the_installed_package_not_the_copied_sources():
    """The build-time check after `pip install .` runs from outside WORKDIR (the copied sources
    shadow the installed package there, hiding a module the wheel left out) and runs the
    console script the manifests start."""
    for image in IMAGES:
        workdir, check = None, None
        for word, args in instructions(DOCKER / f"{image}.Dockerfile"):
            workdir = args if word == "WORKDIR" else workdir
            if word == "RUN" and 'pip install ".[' in args:
                check, source = args.split('pip install ".[', 1)[1], workdir
                break
        assert check is not None, f"{image}: no pip install of the package"
        steps = [s.strip() for s in check.split("&&")[1:]]
        assert steps and steps[0].startswith("cd "), f"{image}: the check runs in {source}"
        target = steps[0].split()[1]
        assert not (target + "/").startswith(source.rstrip("/") + "/"), f"{image}: cd {target}"
        assert "dsv4 --version" in steps, f"{image}: the console script is not run"


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
