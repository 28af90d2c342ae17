"""Ports the launcher picks for the services it starts: below the kernel's ephemeral range (so
no connection's local end takes one before its service binds it), and a service that still
finds its port taken exits with PortInUse's code, which the launcher answers with a start on
fresh ports. A cluster's start once failed because a worker's picked metrics port had been
given to some connection in the seconds before the worker bound it."""

from __future__ import annotations

import socket
import subprocess
import sys

from dsv4.errors import PortInUse
from dsv4.serving import ports
from dsv4.serving.ports import bind_problem, free_port, listen_failure


def test_free_ports_are_fresh_bindable_and_below_the_ephemeral_range() -> None:
    low, _ = ports._ephemeral_range()
    picked = [free_port() for _ in range(50)]
    assert len(set(picked)) == len(picked)
    assert all(ports.LOWEST_PICKED_PORT <= p < low for p in picked), picked
    assert all(bind_problem("127.0.0.1", p) == "" for p in picked)


def test_a_port_another_process_listens_on_is_port_in_use() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        error = listen_failure("127.0.0.1", port, "serve gRPC", "pick a free port", "bind failed")
        assert isinstance(error, PortInUse) and error.port == port
        assert (
            error.message
            == f"cannot serve gRPC on 127.0.0.1:{port} (already in use): pick a free port"
        )
    error = listen_failure("127.0.0.1", port, "serve gRPC", "pick a free port", "bind failed")
    assert not isinstance(error, PortInUse)  # free again: some other failure, said as it was


def test_the_router_on_a_taken_port_exits_with_one_line_and_the_retry_code() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["router", "--port", str(port), "--prefill", "127.0.0.1:1", "--decode",
                "127.0.0.1:2", "--metrics-port", "0", "--shared-secret", "s" * 32]  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "dsv4.commands.cli", *argv],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == PortInUse.exit_code, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().endswith(
        f"router: cannot serve the router's gRPC on 127.0.0.1:{port} (already in use): "
        "pick a free --port"
    ), done.stderr
