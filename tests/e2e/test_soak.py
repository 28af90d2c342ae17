"""A bounded soak: `dsv4 loadtest` (240 requests at 3/s, ~80 s, loopback) against `dsv4 up`
(router + P + D processes). Before and after: every KV block free and no lease on both workers,
and each process' RSS (from its /metrics `process_resident_memory_bytes`, measured after a
warm-up) grew by at most SOAK_RSS_GROWTH_BYTES. Opt-in (`make soak`, or DSV4TEST_SOAK=1): it
costs ~2.5 minutes, and its value grows with its length, so it is not in the default run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsv4.commands.cluster import free_port, is_serving, terminate
from dsv4.serving.metrics import scrape
from tests.services.worker_cluster import WORKER_ARGS, tiny_checkpoint

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not os.environ.get("DSV4TEST_SOAK"), reason="opt-in: make soak"),
]
SOAK_RSS_GROWTH_BYTES = 64 << 20
SERVICES = ("router", "prefill-0", "decode-0")
SOAK_ARGS = ("--num-blocks", "800", "--max-num-seqs", "128", "--log-level", "info")


def loadtest(target: str, out: Path, num_prompts: int, rate: float) -> dict:
    command = [
        sys.executable, "-m", "dsv4.commands.cli", "loadtest", "--target", target,
        "--num-prompts", str(num_prompts), "--request-rate", str(rate),
        "--random-input-len", "96", "--random-output-len", "24", "--random-range-ratio", "0.5",
        "--timeout-s", "60", "--no-progress", "--result-json", str(out), "--seed", "1",
    ]  # fmt: skip
    subprocess.run(command, check=True, timeout=300, capture_output=True)
    summary = json.loads(out.read_text())
    return summary[0] if isinstance(summary, list) else summary


def snapshot(base_port: int) -> dict[str, dict[str, float]]:
    return {
        name: scrape(f"http://127.0.0.1:{base_port + i}/metrics") for i, name in enumerate(SERVICES)
    }


def test_soak_keeps_blocks_free_and_memory_bounded(tmp_path_factory) -> None:
    model_dir = tiny_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache")
    tmp = tmp_path_factory.mktemp("soak")
    port, metrics_port = free_port(), free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "dsv4.commands.cli", "up", "--model", str(model_dir), "--port", str(port),
         "--log-dir", str(tmp / "logs"), "--metrics-base-port", str(metrics_port),
         "--grace-s", "5", *WORKER_ARGS, *SOAK_ARGS],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    target = f"127.0.0.1:{port}"
    try:
        give_up_s = time.monotonic() + 180
        while not is_serving(target, "dsv4.v1.Router"):
            assert up.poll() is None and time.monotonic() < give_up_s, "dsv4 up did not start"
            time.sleep(0.5)
        warm = loadtest(target, tmp / "warm.json", num_prompts=60, rate=10)
        assert warm["failed"] == 0, warm
        time.sleep(2.0)
        before = snapshot(metrics_port)
        soak = loadtest(target, tmp / "soak.json", num_prompts=240, rate=3)
        time.sleep(2.0)  # leases and cleanups settle
        after = snapshot(metrics_port)
        assert up.poll() is None, "dsv4 up exited during the soak"
    finally:
        terminate(up, 2)  # SIGINT: `dsv4 up` stops its services in order
        up.wait(timeout=60)
    assert soak["failed"] == 0 and soak["completed"] == 240, soak
    rss = {}
    for name in SERVICES:
        for when in (before, after):
            m = when[name]
            if name != "router":
                assert m["dsv4_worker_kv_blocks_used"] == 0, (name, m)
                assert m["dsv4_worker_running_requests"] == 0
            if name == "prefill-0":
                assert m["dsv4_prefill_leases_live"] == 0
        rss[name] = (
            before[name]["process_resident_memory_bytes"],
            after[name]["process_resident_memory_bytes"],
        )
    print(
        "soak RSS MiB (before -> after):", {n: (b / 2**20, a / 2**20) for n, (b, a) in rss.items()}
    )
    print(f"soak: {soak['completed']} requests, {soak['request_throughput']:.2f} req/s, "
          f"p99 TTFT {soak.get('p99_ttft_ms', 0):.0f} ms")  # fmt: skip
    for name, (b, a) in rss.items():
        assert a - b <= SOAK_RSS_GROWTH_BYTES, f"{name}: RSS grew {(a - b) / 2**20:.1f} MiB"
