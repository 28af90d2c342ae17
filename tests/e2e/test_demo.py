"""`make demo` is `dsv4 demo`: a local cluster, a short load test, the report, a clean exit 0."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dsv4.commands.cluster import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_dsv4_demo_runs_and_exits_zero(tmp_path_factory) -> None:
    cache_dir = tmp_path_factory.getbasetemp() / "dsv4-cache"
    command = [
        sys.executable, "-m", "dsv4.commands.cli", "demo", "--port", str(free_port()),
        "--cache-dir", str(cache_dir), "--layers", "0,4", "--grace-s", "5",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert "Serving Benchmark Result" in done.stdout
    assert "Successful requests:                    16" in done.stdout
    assert "Failed requests:                        0" in done.stdout
