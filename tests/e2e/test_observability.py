"""Metrics and logs of a real cluster (`dsv4 up`-style: router + P + D processes, JSON logs,
/metrics on every process): counters move as requests pass, live gauges return to idle, the
series vLLM has names for carry vLLM's name and `model_name` on every service, and one
request's id appears in the router's, P's and D's log files."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys

import grpc
import pytest
from e2e_cluster import assert_no_worker_leaks, generate, greedy

from dsv4.commands.cluster import AUTO_PORTS, free_port
from dsv4.serving.metrics import scrape
from tests.services.worker_cluster import PROMPTS, WORKER_ARGS, start_cluster, tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
NUM_OK, MAX_NEW_TOKENS = 3, 5
OBS_ARGS = (*WORKER_ARGS, "--log-level", "info", "--log-format", "json")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    model_dir = tiny_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache")
    log_dir = tmp_path_factory.mktemp("logs")
    cluster = start_cluster(
        model_dir, router_port=free_port(), metrics_base_port=AUTO_PORTS,
        log_dir=str(log_dir), service_args=OBS_ARGS,
    )  # fmt: skip
    try:
        asyncio.run(_traffic(cluster.router_address))
        asyncio.run(assert_no_worker_leaks(cluster))
        yield cluster
    finally:
        cluster.stop()


async def _traffic(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        outcomes = await asyncio.gather(
            *(
                generate(channel, PROMPTS[i], greedy(MAX_NEW_TOKENS), request_id=f"obs-{i}")
                for i in range(NUM_OK)
            )
        )
        assert [o.code for o in outcomes] == [grpc.StatusCode.OK] * NUM_OK
        bad = await generate(channel, [5, 6], greedy(0), request_id="obs-bad")
        assert bad.code is grpc.StatusCode.INVALID_ARGUMENT


def metrics_of(cluster, name: str) -> dict[str, float]:
    return scrape(cluster.service(name).metrics_url)


def vllm_series(cluster, name: str) -> dict[str, float]:
    """The service's vllm:* samples with the model_name label dropped from the key, after
    checking every one of them carries model_name = the served model."""
    label = f'model_name="{cluster.spec.model_dir}"'
    found = {k: v for k, v in metrics_of(cluster, name).items() if k.startswith("vllm:")}
    assert found and all(label in k for k in found), (name, sorted(found))
    return {k.replace(label, "").replace("{,", "{").replace(",}", "}").replace("{}", ""): v
            for k, v in found.items()}  # fmt: skip


def test_router_metrics_count_requests_latencies_and_tokens(cluster) -> None:
    m = metrics_of(cluster, "router")
    assert m['dsv4_router_requests_total{code="OK",method="Generate"}'] == NUM_OK
    assert m['dsv4_router_requests_total{code="INVALID_ARGUMENT",method="Generate"}'] == 1
    v = vllm_series(cluster, "router")
    for name in ("time_to_first_token", "e2e_request_latency", "request_time_per_output_token"):
        assert v[f"vllm:{name}_seconds_count"] == NUM_OK, name
        assert v[f"vllm:{name}_seconds_sum"] > 0, name
    assert v["vllm:inter_token_latency_seconds_count"] >= NUM_OK * (MAX_NEW_TOKENS - 1)
    assert v["vllm:generation_tokens_total"] == NUM_OK * MAX_NEW_TOKENS
    assert v["vllm:prompt_tokens_total"] == sum(len(p) for p in PROMPTS[:NUM_OK])
    assert v["vllm:num_requests_running"] == 0
    assert not [k for k in m if k.startswith("dsv4_router_time_to_first")]  # one name each
    assert m['dsv4_router_workers{health="healthy",role="prefill"}'] == 1
    assert m['dsv4_router_workers{health="healthy",role="decode"}'] == 1
    for name in ("prefill_retries", "migrations", "decode_failures"):
        assert m[f"dsv4_router_{name}_total"] == 0, name


def test_prefill_metrics_count_exports_and_return_to_idle(cluster) -> None:
    m = metrics_of(cluster, "prefill-0")
    assert m['dsv4_worker_info{role="prefill",worker_id="prefill-0"}'] == 1
    assert m["dsv4_prefill_kv_exports_total"] == NUM_OK
    assert m["dsv4_prefill_time_seconds_count"] == NUM_OK
    assert m["dsv4_prefill_leases_live"] == 0 and m["dsv4_prefill_lease_expiries_total"] == 0
    assert m["dsv4_worker_kv_blocks_used"] == 0 and m["dsv4_worker_kv_blocks_free"] > 0
    assert m["dsv4_worker_running_requests"] == 0
    assert m["dsv4_prefill_queued_tokens"] == 0
    assert m['dsv4_engine_steps_total{kind="prefill"}'] >= 1  # prompts may share a step
    assert m['dsv4_engine_steps_total{kind="graph"}'] == 0  # a prefill worker never decodes
    assert m['dsv4_engine_step_seconds_total{kind="prefill"}'] > 0


def test_decode_metrics_count_pulls_and_bytes(cluster) -> None:
    m = metrics_of(cluster, "decode-0")
    assert m["dsv4_decode_kv_pull_seconds_count"] == NUM_OK
    assert m["dsv4_decode_kv_transfer_bytes_total"] > 0
    assert m["dsv4_decode_kv_pull_failures_total"] == 0
    assert m["dsv4_decode_prefill_recomputes_total"] == 0
    assert m["dsv4_decode_mtp_drafted_tokens_total"] == 0  # MTP off: the counters exist, at 0
    assert m["dsv4_decode_mtp_accepted_tokens_total"] == 0
    assert m["dsv4_worker_index_cache_hit_ratio"] == 0
    assert m["dsv4_worker_kv_blocks_used"] == 0 and m["dsv4_worker_running_requests"] == 0
    # CPU workers run no graphs: every decode step of the adopted requests is eager, none is a
    # prefill (the prompt's KV was pulled, not recomputed)
    assert m['dsv4_engine_steps_total{kind="eager"}'] >= MAX_NEW_TOKENS - 1
    assert m['dsv4_engine_steps_total{kind="prefill"}'] == 0
    assert m['dsv4_engine_steps_total{kind="graph"}'] == 0


@pytest.mark.parametrize("name", ["prefill-0", "decode-0"])
def test_workers_export_vllm_engine_gauges_with_model_name(cluster, name) -> None:
    v = vllm_series(cluster, name)
    assert v == dict.fromkeys(WORKER_VLLM_NAMES, 0)  # idle: nothing queued, every block free


WORKER_VLLM_NAMES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
}  # fmt: skip
ROUTER_VLLM_NAMES = {
    "vllm:num_requests_running", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
    "vllm:request_time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
}  # fmt: skip


def test_dsv4_up_prints_metrics_urls_and_logs_and_metrics_are_on_by_default(
    tmp_path, tmp_path_factory
) -> None:
    """No metrics flag given: every service serves /metrics, the start-up line names each URL
    and the log directory, and each URL answers with vLLM's names for this model."""
    model_dir = tiny_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache")
    command = [sys.executable, "-m", "dsv4.commands.cli", "up", "--port", str(free_port()),
               "--model", str(model_dir), "--log-dir", str(tmp_path / "logs"), *WORKER_ARGS]  # fmt: skip
    up = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        line = up.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("dsv4 cluster up:"), line
        assert f"logs {tmp_path / 'logs'};" in line
        urls = dict(re.findall(r"(\S+)=(http://\S+/metrics)", line))
        assert set(urls) == {"router", "prefill-0", "decode-0"}, line
        label = f'model_name="{model_dir}"'
        for name, url in urls.items():
            names = {k.split("{")[0] for k in scrape(url) if label in k}
            expected = ROUTER_VLLM_NAMES if name == "router" else WORKER_VLLM_NAMES
            assert expected <= names, (name, sorted(names))
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0


def json_lines(cluster, name: str) -> list[dict]:
    lines = cluster.service(name).log_path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def test_one_request_id_appears_in_router_prefill_and_decode_logs(cluster) -> None:
    for name in ("router", "prefill-0", "decode-0"):
        lines = json_lines(cluster, name)
        assert lines, f"{name} wrote no JSON log lines"
        assert all(
            set(line) >= {"ts", "level", "logger", "msg", "request_id", "worker_id"}
            for line in lines
        )
        mine = [line for line in lines if line["request_id"] == "obs-1"]
        assert mine, f"request obs-1 is not in {name}'s log"
        expected_worker = "router-127.0.0.1:" if name == "router" else name
        assert all(line["worker_id"].startswith(expected_worker) for line in mine)
    router_lines = [x["msg"] for x in json_lines(cluster, "router") if x["request_id"] == "obs-bad"]
    assert any("INVALID_ARGUMENT" in msg for msg in router_lines)
