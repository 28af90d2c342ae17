"""A real `redis-server` for tests: own process, free loopback port, no persistence, tmp dir.

`RedisServer` can stop and restart on the same port, or pause and resume (to test outages). The `redis_server`
fixture starts one per test and always stops it. Tests are skipped if `redis-server` is missing.
"""

from __future__ import annotations

import logging
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsv4.serving.ports import free_port

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0


class RedisServer:
    def __init__(self, executable: str = "redis-server") -> None:
        path = shutil.which(executable) or (
            "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None
        )
        if path is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self.executable = path
        self.port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="dsv4-redis-")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        assert not self.is_running, "already running"
        command = [
            self.executable,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            "--logfile", str(Path(self._dir.name) / "redis.log"),
        ]  # fmt: skip
        self._process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_until_ready()

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_TIMEOUT_S)

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing answers (a hung Redis / a partition)."""
        assert self._process is not None and self.is_running
        self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._process is not None
        self._process.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                log = Path(self._dir.name, "redis.log")
                text = log.read_text() if log.exists() else ""
                raise RuntimeError(
                    f"redis-server exited with {self._process.returncode}: {text[-2000:]}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(64).startswith(b"+PONG"):
                        return
            except OSError as exc:
                logger.debug("redis-server not ready yet: %s", exc)
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(
            f"redis-server did not answer PING on port {self.port} in {START_TIMEOUT_S} s"
        )


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    try:
        server = RedisServer()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    server.start()
    try:
        yield server
    finally:
        server.close()
