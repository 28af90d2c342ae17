"""`dsv4 router` as a process (signals, exit codes) and TLS on both sides of the router,
against scripted peers (tests.router_fakes.scripted_workers)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dsv4.config import load_config
from dsv4.discovery.static import StaticWorkerRegistry
from dsv4.rpc.v1 import router_pb2_grpc
from dsv4.serving.ports import free_port
from router_svc.server import RouterServer, main
from tests.router_fakes.harness import FAST_PROBES, generate_request, tiny_text_model
from tests.router_fakes.scripted_workers import ScriptedDecodeWorker, ScriptedPrefillWorker

REPO = Path(__file__).resolve().parents[2]
WITH_SECRET = {**os.environ, "DSV4_SHARED_SECRET": "router-process-test-secret"}


def test_main_serves_until_sigterm_and_exits_cleanly() -> None:
    port = free_port()
    code = "import sys; from router_svc.server import main; sys.exit(main(sys.argv[1:]))"
    args = ["--port", str(port), "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:9"]
    process = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
        env=WITH_SECRET,
    )
    try:

        async def wait_serving() -> None:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                for _ in range(100):
                    try:
                        answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                        if answer.status == health_pb2.HealthCheckResponse.SERVING:
                            return
                    except grpc.aio.AioRpcError:
                        await asyncio.sleep(0.05)
                raise AssertionError("the router never answered its health check")

        asyncio.run(wait_serving())
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=5) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "serving dsv4.v1.Router" in process.stderr.read()


def test_a_router_without_a_shared_secret_refuses_to_start() -> None:
    """Worker RPCs always need the secret, so a router without one could reach no worker."""
    env = {k: v for k, v in os.environ.items() if k != "DSV4_SHARED_SECRET"}
    done = subprocess.run(
        [sys.executable, "-m", "dsv4.commands.cli", "router", "--port", "0", "--prefill", "127.0.0.1:9",
         "--decode", "127.0.0.1:9"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "security.shared_secret" in lines[0], done.stderr


def test_a_service_started_with_parent_pid_dies_with_its_launcher() -> None:
    """`dsv4 up` starts services with --parent-pid: a SIGKILLed launcher leaves no orphans."""
    port = free_port()
    launcher_code = (
        "import os, subprocess, sys, time\n"
        "cmd = [sys.executable, '-m', 'dsv4.commands.cli', '--parent-pid', str(os.getpid()), 'router',\n"
        f"       '--port', '{port}', '--prefill', '127.0.0.1:9', '--decode', '127.0.0.1:9']\n"
        "child = subprocess.Popen(cmd, start_new_session=True)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", launcher_code],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env=WITH_SECRET,
    )
    child_pid = int(launcher.stdout.readline())
    try:
        time.sleep(1.0)  # the router is importing / serving: it must not have exited by itself
        assert _is_running(child_pid)
        launcher.kill()
        launcher.wait(timeout=10)
        for _ in range(200):  # bounded: 20 s
            if not _is_running(child_pid):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the service outlived its launcher")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child_pid, signal.SIGKILL)


def _is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_parent_pid_that_is_not_the_parent_refuses_to_start() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dsv4.commands.cli", "--parent-pid", "1", "plan", "--shape", "flash", "--gpu-mem", "80"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0 and "launcher 1 is gone" in done.stderr


def test_main_rejects_a_bad_config_with_exit_code_2() -> None:
    with pytest.raises(SystemExit) as info:
        main(["--prefill", "not-an-address"])
    assert info.value.code == 2


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return cert, key


def test_tls_from_client_to_router_to_workers(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])

    async def body() -> None:
        prefill, decode = ScriptedPrefillWorker("p0"), ScriptedDecodeWorker("d0")
        await prefill.start(creds)
        await decode.start(creds)
        cfg = load_config(
            {
                "router.port": 0,
                "security.tls_cert_path": str(cert),
                "security.tls_key_path": str(key),
                "security.tls_ca_path": str(cert),
            }
        )
        registry = StaticWorkerRegistry([prefill.address], [decode.address])
        server = RouterServer(
            cfg, registry=registry, pool_settings=FAST_PROBES, text_model=tiny_text_model()
        )
        await server.start()
        try:
            client_creds = grpc.ssl_channel_credentials(cert.read_bytes())
            async with grpc.aio.secure_channel(server.address, client_creds) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                messages = [m async for m in stub.Generate(generate_request(3, [5, 6, 7]))]
                assert sum(len(m.token_ids) for m in messages) == 3
            async with grpc.aio.insecure_channel(server.address) as plain:
                health = health_pb2_grpc.HealthStub(plain)
                with pytest.raises(grpc.aio.AioRpcError):
                    await health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        finally:
            await server.stop(0.5)
            await prefill.stop()
            await decode.stop()

    asyncio.run(asyncio.wait_for(body(), 8.0))
