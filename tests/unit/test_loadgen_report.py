"""Output formats: the summary JSON schema is pinned key by key (changing it needs a
SCHEMA_VERSION bump), per-request JSONL, the console table, and the plot file."""

from __future__ import annotations

import io
import json
import math

import pytest

from dsv4.types import Usage
from loadgen.client import RequestRecord
from loadgen.metrics import parse_goodput, summarize
from loadgen.report import (
    SCHEMA_VERSION,
    RunInfo,
    format_summary_table,
    format_sweep_table,
    summary_to_json,
    write_per_request_jsonl,
    write_result_json,
)
from loadgen.runner import RunResult

RECORDS = (
    RequestRecord("a", 10, 3, 0.0, 0.5, (0.25, 0.375), (1, 2), usage=Usage(11, 3), scheduled_s=0.0),
    RequestRecord("b", 10, 3, 0.0, 0.125, status_code="UNAVAILABLE", error="no decode worker"),
)
INFO = RunInfo("h:1", "random", 2, "poisson", 1.0, 0, 0, ("ttft", "itl"))

STAT_KEYS = {
    f"{stat}_{metric}_ms"
    for stat in ("mean", "median", "std")
    for metric in ("ttft", "tpot", "itl", "e2el")
}
PERCENTILE_KEYS = {f"p{p}_{m}_ms" for p in ("90", "99", "99.9") for m in ("ttft", "itl")}
SUMMARY_KEYS = {
    "schema_version", "label", "date", "backend", "model_id", "tokenizer_id", "target", "dataset_name", "num_prompts",
    "request_rate", "request_rate_mode", "burstiness", "max_concurrency", "seed", "num_warmups",
    "duration", "completed", "failed", "failed_by_status", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "num_good_requests",
    "goodput_slos_ms", "input_throughput", "output_throughput", "total_token_throughput",
    "max_output_tokens_per_s", "max_concurrent_requests", "mean_tokens_per_chunk",
    "num_server_usage_reports", "num_token_count_mismatches", "num_prefill_retries",
    "num_prefill_recomputed", "spec_decode_acceptance_rate", "percentiles",
    "metric_definitions",
} | STAT_KEYS | PERCENTILE_KEYS  # fmt: skip
REQUEST_KEYS = {
    "request_id", "request_rate", "status_code", "error", "finish_reason", "input_tokens",
    "output_tokens", "requested_output_tokens", "server_usage", "scheduled_s", "start_s",
    "end_s", "ttft_ms", "tpot_ms", "e2el_ms", "itl_ms", "chunk_num_tokens",
}  # fmt: skip


def _summary(rate: float = math.inf):
    return summarize(RECORDS, 1.0, 0.0, rate, 4, (90, 99, 99.9), parse_goodput(["ttft:300"]))


def test_summary_json_schema_is_pinned(tmp_path):
    obj = summary_to_json(_summary(), INFO)
    assert SCHEMA_VERSION == 2
    assert set(obj) == SUMMARY_KEYS
    assert obj["request_rate"] == "inf" and obj["max_concurrency"] == 4
    assert obj["failed_by_status"] == {"UNAVAILABLE": 1}
    assert obj["goodput_slos_ms"] == {"ttft": 300.0}
    assert obj["total_input_tokens"] == 11  # the server's prompt_tokens wins
    assert obj["mean_ttft_ms"] == 250.0 and obj["p90_itl_ms"] == 125.0
    assert obj["request_goodput"] == 1.0
    path = tmp_path / "one.json"
    write_result_json(str(path), [obj], is_sweep=False)
    assert json.loads(path.read_text())["completed"] == 1
    write_result_json(str(path), [obj, obj], is_sweep=True)
    assert [o["completed"] for o in json.loads(path.read_text())] == [1, 1]


def test_per_request_jsonl():
    stream = io.StringIO()
    write_per_request_jsonl(stream, RECORDS, 0.0, 2.0)
    rows = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [set(r) for r in rows] == [REQUEST_KEYS, REQUEST_KEYS]
    ok, bad = rows
    assert (ok["ttft_ms"], ok["tpot_ms"], ok["e2el_ms"], ok["itl_ms"]) == (250, 125, 500, [125])
    assert ok["server_usage"]["prompt_tokens"] == 11 and ok["request_rate"] == 2.0
    assert (bad["status_code"], bad["ttft_ms"], bad["itl_ms"]) == ("UNAVAILABLE", None, [])
    assert bad["error"] == "no decode worker"


def test_console_tables():
    text = format_summary_table(_summary(), INFO)
    assert "Serving Benchmark Result" in text
    assert "  UNAVAILABLE:" in text and "Request goodput (req/s):" in text
    assert "P99.9 TTFT (ms):" in text and "P99 TPOT (ms):" not in text  # tpot not selected
    assert "Median TPOT (ms):" in text
    sweep = format_sweep_table([_summary(1.0), _summary()])
    assert len(sweep.splitlines()) == 4 and "inf" in sweep.splitlines()[-1]


def test_plot_file_written(tmp_path):
    pytest.importorskip("matplotlib")
    from loadgen.plot import write_plot

    result = RunResult(math.inf, None, RECORDS, 0.0, 1.0)
    path = tmp_path / "single.png"
    write_plot(str(path), [result], [_summary()])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
    sweep = tmp_path / "sweep.png"  # adds the latency-vs-throughput (Pareto) panels
    write_plot(
        str(sweep), [RunResult(1.0, None, RECORDS, 0.0, 1.0), result], [_summary(1.0), _summary()]
    )
    assert sweep.stat().st_size > path.stat().st_size


def test_pareto_frontier_keeps_the_points_nothing_beats():
    from loadgen.plot import pareto_frontier

    points = [(10, 5), (20, 6), (15, 7), (30, 20), (25, 30), (5, 4)]
    # (15, 7) loses to (20, 6) on both; (25, 30) to (30, 20)
    assert pareto_frontier(points) == [(5, 4), (10, 5), (20, 6), (30, 20)]
