"""`dsv4 loadtest` against a real local cluster (router + prefill + decode processes): every
request completes, and the tester's counts and token totals equal what the server reported in
each stream's usage; the workers end leak-free."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from worker_cluster import start_cluster, tiny_checkpoint

from dsv4.commands.cluster import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
NUM_PROMPTS = 12


def test_loadtest_totals_match_the_servers_usage(tmp_path, tmp_path_factory) -> None:
    model_dir = tiny_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache")
    cluster = start_cluster(model_dir, router_port=free_port())
    try:
        summary_path, records_path = tmp_path / "summary.json", tmp_path / "requests.jsonl"
        command = [
            sys.executable, "-m", "dsv4.commands.cli", "loadtest", "--target", cluster.router_address,
            "--num-prompts", str(NUM_PROMPTS), "--random-input-len", "48",
            "--random-output-len", "12", "--random-range-ratio", "0.5", "--max-concurrency", "6",
            "--timeout-s", "60", "--no-progress", "--result-json", str(summary_path),
            "--per-request-jsonl", str(records_path),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "Successful requests:" in done.stdout
        summary = json.loads(summary_path.read_text())
        summary = summary[0] if isinstance(summary, list) else summary
        records = [json.loads(line) for line in records_path.read_text().splitlines()]
        assert summary["completed"] == NUM_PROMPTS and summary["failed"] == 0
        assert (summary["backend"], summary["model_id"]) == ("grpc", str(model_dir))
        assert len(records) == NUM_PROMPTS
        usages = [r["server_usage"] for r in records]
        assert all(u is not None for u in usages)
        for record, usage in zip(records, usages):
            assert record["output_tokens"] == usage["completion_tokens"]
            assert record["input_tokens"] == usage["prompt_tokens"]
            assert usage["kv_transfer_ms"] > 0 and usage["decode_worker_id"] == "decode-0"
        assert summary["total_output_tokens"] == sum(u["completion_tokens"] for u in usages)
        assert summary["total_input_tokens"] == sum(u["prompt_tokens"] for u in usages)
        from tests.e2e.e2e_cluster import assert_no_worker_leaks

        asyncio.run(assert_no_worker_leaks(cluster))
    finally:
        cluster.stop()
