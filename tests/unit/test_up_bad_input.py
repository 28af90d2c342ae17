"""`dsv4 up` / `dsv4 demo` on bad input: one line on stderr naming the flag, exit 2, and nothing
started (a worker count nobody meant once filled the host's memory; a port another cluster held
once got its load test). In-process through `dsv4.commands.cli.main`, with `LocalCluster`
replaced by one that fails the test if anything would start; two runs as real processes."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import pytest

import dsv4.commands.up as up
from dsv4.commands.cli import DEBUG_ENV, main
from dsv4.commands.cluster import (
    ClusterSpec,
    LocalCluster,
    StartFailed,
    _Service,
    error_line,
)
from dsv4.commands.layout import PROCESS_HOST_BYTES, check_host_memory
from dsv4.commands.service_args import service_config
from dsv4.errors import UsageError
from dsv4.serving.ports import bind_problem, owns_listener

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30
REAL_START = LocalCluster.start


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from dsv4.model.tiny import tiny_config, write_model_spec

    return str(write_model_spec(tmp_path_factory.mktemp("spec"), tiny_config()))


@pytest.fixture
def listening() -> socket.socket:
    """Another server's port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("DSV4_")]:
        monkeypatch.delenv(name)

    def refuse(self: LocalCluster, ready_timeout_s: float | None = None) -> None:
        raise AssertionError(f"a cluster started: {self.spec}")

    monkeypatch.setattr(LocalCluster, "start", refuse)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def up_argv(model_dir: str, *flags: str, command: str = "up") -> list[str]:
    return [command, "--model", model_dir, "--device", "cpu", *flags]


BAD = [
    (["--num-prefill", "100000"], "--num-prefill 100000"),  # spawned until the OOM killer came
    (["--num-decode", "65"], "--num-decode 65"),
    (["--prefill-ranks", "1000"], "--prefill-ranks 1000"),
    (["--ready-timeout-s", "-3"], "--ready-timeout-s -3"),
    (["--ready-timeout-s", "nan"], "--ready-timeout-s nan"),
    (["--ready-timeout-s", "0"], "--ready-timeout-s 0"),
    (["--grace-s", "nan"], "--grace-s nan"),
    (["--grace-s", "-1"], "--grace-s -1"),
    (["--grace-s", "inf"], "--grace-s inf"),
    (["--metrics-base-port", "-1"], "--metrics-base-port -1"),
    (["--metrics-base-port", "65536"], "--metrics-base-port 65536"),
    (["--metrics-base-port", "65535"], "--metrics-base-port 65535"),  # workers past 65535
    (["--port", "40000", "--http-port", "40000"], "--http-port 40000"),
    (["--port", "40001", "--metrics-base-port", "40000"], "--metrics-base-port 40000"),
    (["--bogus-flag", "3"], "--bogus-flag 3"),  # every service would refuse it
    (["--num-blocks", "x"], "--num-blocks"),
    (["--redis", "notaurl"], "--redis"),
    (["--layers", "0,7"], "--layers 0,7"),  # a checkpoint dir has its own layers
    (["--host", "nosuchhost.invalid"], "--host nosuchhost.invalid"),
]


@pytest.mark.parametrize(("flags", "names"), BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_up_flags_exit_2_naming_the_flag_before_anything_starts(
    flags: list[str], names: str, model_dir: str, capsys
) -> None:
    code, out, err = run(up_argv(model_dir, *flags), capsys)
    lines = err.strip().splitlines()
    assert code == 2 and out == "", (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("dsv4 up: error: ") and names in lines[0], err


@pytest.mark.parametrize("layers", ["x", "0,,4", "0,3"])
def test_tiny_layers_that_are_not_ratios_exit_2_naming_layers(
    layers: str, tmp_path: Path, capsys
) -> None:
    argv = ["up", "--device", "cpu", "--cache-dir", str(tmp_path), "--layers", layers]
    code, out, err = run(argv, capsys)
    assert code == 2 and out == "" and err.startswith(f"dsv4 up: error: --layers {layers}:"), err
    assert len(err.strip().splitlines()) == 1 and not list(tmp_path.iterdir())


@pytest.mark.parametrize("flag", ["--port", "--http-port", "--metrics-base-port"])
def test_a_port_in_use_exits_2_naming_its_flag(
    flag: str, listening: socket.socket, model_dir: str, capsys
) -> None:
    taken = listening.getsockname()[1]
    flags = [flag, str(taken)]
    if flag != "--port":
        flags += ["--port", str(_free_port_away_from(taken))]
    code, out, err = run(up_argv(model_dir, *flags), capsys)
    assert code == 2 and out == "", err
    assert err.startswith(f"dsv4 up: error: {flag} {taken}: ") and "in use" in err, err


def test_demo_refuses_a_taken_port_and_bad_load_flags_before_starting(
    listening: socket.socket, model_dir: str, capsys
) -> None:
    """It used to run its whole load test against the other cluster and report success."""
    taken = str(listening.getsockname()[1])
    code, out, err = run(up_argv(model_dir, "--port", taken, command="demo"), capsys)
    assert code == 2 and out == "" and err.startswith(f"dsv4 demo: error: --port {taken}:"), err
    code, out, err = run(up_argv(model_dir, "--num-prompts", "0", command="demo"), capsys)
    assert code == 2 and out == "" and err.startswith("dsv4 demo: error: --num-prompts 0:"), err
    assert len(err.strip().splitlines()) == 1


def _free_port_away_from(port: int) -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    return free if abs(free - port) > 8 else _free_port_away_from(port)


def test_bind_problem_and_owns_listener(listening: socket.socket) -> None:
    port = listening.getsockname()[1]
    assert "already in use" in bind_problem("127.0.0.1", port)
    assert "already in use" in bind_problem("0.0.0.0", port)
    assert bind_problem("127.0.0.1", _free_port_away_from(port)) == ""
    if not Path("/proc/net/tcp").exists():
        pytest.skip("no /proc/net/tcp")
    assert owns_listener(os.getpid(), port) is True
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as other:
        try:
            assert owns_listener(other.pid, port) is False
        finally:
            other.kill()


def test_readiness_tells_its_own_service_from_a_foreign_server(tmp_path: Path) -> None:
    """A server that held the port first answers SERVING while the service is still starting
    (to fail on the port): that is not the service up."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    if not Path("/proc/net/tcp").exists():
        pytest.skip("no /proc/net/tcp")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    starting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    log = tmp_path / "prefill-0.log"
    log.write_text("")
    cluster = LocalCluster(ClusterSpec(model_dir="unused"))
    service = _Service("prefill-0", "prefill", f"127.0.0.1:{port}", starting, log)
    try:
        with pytest.raises(StartFailed, match="another process answers") as failed:
            cluster.wait_ready(10.0, [service])
        assert failed.value.foreign
    finally:
        starting.kill()
        starting.wait()
        server.stop(0)


def test_check_host_memory_refuses_workers_the_host_cannot_hold(model_dir: str) -> None:
    cpu = service_config(("--model", model_dir, "--device", "cpu"), {})
    resolved = {"prefill": cpu, "decode": cpu}
    many = ClusterSpec(model_dir, num_prefill=20, num_decode=20)
    with pytest.raises(UsageError, match=r"--num-prefill 20 --num-decode 20: 40 worker"):
        check_host_memory(many, many, resolved, available=8 * GIB)
    check_host_memory(many, many, resolved, available=40 * PROCESS_HOST_BYTES)
    check_host_memory(many, many, resolved, available=0)  # unknown: not checked
    one_each = ClusterSpec(model_dir)
    check_host_memory(one_each, one_each, resolved, available=2 * PROCESS_HOST_BYTES + GIB)


def test_ready_timeout_reaches_the_wait(model_dir: str, monkeypatch) -> None:
    """`--ready-timeout-s` was parsed and dropped (always 120 s)."""
    waits: list[float] = []
    monkeypatch.setattr(LocalCluster, "start", REAL_START)  # it starts no service here
    monkeypatch.setattr(LocalCluster, "wait_ready", lambda self, t, s=None: waits.append(t))
    args = _up_args(model_dir, "--ready-timeout-s", "7.5")
    spec, _ = up.cluster_from_args(args)
    assert spec.ready_timeout_s == 7.5
    LocalCluster(_no_services(spec)).start()
    assert waits == [7.5]


def _no_services(spec: ClusterSpec) -> ClusterSpec:
    import dataclasses

    return dataclasses.replace(spec, num_prefill=0, num_decode=0, with_router=False)


def _up_args(model_dir: str, *flags: str) -> argparse.Namespace:
    from dsv4.commands.cli import build_parser

    args, extra = build_parser().parse_known_args(up_argv(model_dir, *flags))
    args.extra_args, args.argv = extra, []
    return args


def _failed(tmp_path: Path, log: str, **kwargs: object) -> StartFailed:
    path = tmp_path / "prefill-0.log"
    path.write_text(log)
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    return StartFailed(_Service("prefill-0", "prefill", "x:1", done, path), "did not start",
                       **kwargs)  # type: ignore[arg-type]  # fmt: skip


def test_a_failed_start_is_one_line_on_stderr_with_the_services_own_error(
    model_dir: str, tmp_path: Path, capsys
) -> None:
    """It was the log tail on stdout and exit 1, whatever the service's exit status."""
    log = "2026 INFO starting\ndsv4 prefill: error: config field 'o_groups' = 2: must be ...\n"
    args = _up_args(model_dir, "--prefill-ranks", "3")
    assert up._start_failed(args, _failed(tmp_path, log, exit_code=2)) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("dsv4 up: error: prefill-0 (--prefill-ranks 3) did not start: config")
    assert up._start_failed(args, _failed(tmp_path, "Segmentation fault\n", exit_code=-11)) == 1
    assert "Segmentation fault" in capsys.readouterr().err
    assert (
        error_line("dsv4 router: --redis 'x': start with redis://\n")
        == "--redis 'x': start with redis://"
    )


def test_waiting_for_redis_is_said_and_named_in_the_timeout(
    model_dir: str, tmp_path: Path, capsys
) -> None:
    """It waited silently (no message in 45 s) for a Redis that was not there."""
    url = f"redis://127.0.0.1:{_free_port_away_from(0)}"
    args = _up_args(model_dir, "--redis", url, "--ready-timeout-s", "30")
    up._say_redis_wait(args)
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and f"waiting for Redis at {url} (--redis)" in err, err
    assert up._start_failed(args, _failed(tmp_path, "")) == 1
    err = capsys.readouterr().err
    assert "--ready-timeout-s 30" in err and f"Redis at {url} (--redis)" in err, err


def _process(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != DEBUG_ENV and not k.startswith("DSV4_")}
    return subprocess.run([sys.executable, "-m", "dsv4.commands.cli", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=150)  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_service_user_error_reaches_the_terminal_as_one_line_exit_2(model_dir: str) -> None:
    """A prefill worker that refuses its rank count (exit 2): up's one line names the user's
    flag and carries the worker's message; nothing on stdout."""
    port = str(_free_port_away_from(0))
    done = _process(["up", "--model", f"random:{model_dir}", "--device", "cpu", "--port", port,
                     "--prefill-ranks", "3", "--grace-s", "2", "--ready-timeout-s", "100"])  # fmt: skip
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("dsv4 up: error: prefill-0 (--prefill-ranks 3) exited with 2")
    assert "divisible by the world size 3" in done.stderr
