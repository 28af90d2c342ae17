"""The runner against in-process fake clients: schedule, concurrency cap, client failures,
progress output, and the CLI flow end to end (tables, JSON, JSONL, plot) without a server."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math

import pytest

from loadgen.arrivals import ArrivalSpec
from loadgen.cli import add_loadtest_args, main, run_loadtest
from loadgen.client import ModelInfoView, RecordBuilder, RequestRecord, TokenListener
from loadgen.progress import LiveProgress
from loadgen.runner import run_once
from loadgen.workloads import LengthRange, LoadRequest, random_requests


class FakeClient:
    """Streams `output_len` tokens, two per message, `delay_s` apart; ids ending in 7 fail."""

    def __init__(self, delay_s: float = 0.002) -> None:
        self.delay_s = delay_s
        self.in_flight = 0
        self.peak_in_flight = 0
        self.seen: list[LoadRequest] = []

    async def generate(
        self, request: LoadRequest, listener: TokenListener | None = None
    ) -> RequestRecord:
        self.seen.append(request)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        builder = RecordBuilder(request, listener)
        try:
            if request.request_id.endswith("7"):
                return builder.build("RESOURCE_EXHAUSTED", "admission full")
            left = request.output_len
            while left > 0:
                await asyncio.sleep(self.delay_s)
                builder.on_message(min(2, left))
                left -= 2
            return builder.build()
        finally:
            self.in_flight -= 1

    async def fetch_model_info(self) -> ModelInfoView:
        return ModelInfoView("fake", 777, 4096, "none")


class BrokenClient:
    async def generate(self, request: LoadRequest, listener=None) -> RequestRecord:
        raise RuntimeError("bug in client")


def _requests(num: int) -> list[LoadRequest]:
    return random_requests(num, LengthRange(8), LengthRange(5), 100, seed=0)


def test_concurrency_cap_and_records_in_order():
    client = FakeClient()
    result = asyncio.run(run_once(client, _requests(12), ArrivalSpec(), max_concurrency=3))
    assert client.peak_in_flight == 3
    assert [r.request_id for r in result.records] == [f"req-{i}" for i in range(12)]
    ok = [r for r in result.records if r.is_success]
    assert len(ok) == 11 and all(r.num_output_tokens == 5 for r in ok)
    assert all(r.chunk_num_tokens == (2, 2, 1) for r in ok)
    assert result.records[7].status_code == "RESOURCE_EXHAUSTED"
    # Capped requests waited: sent after they were due.
    assert max(r.start_s - r.scheduled_s for r in result.records) > 0.003


def test_constant_rate_spacing():
    spec = ArrivalSpec(request_rate=100.0, mode="constant")
    result = asyncio.run(run_once(FakeClient(), _requests(5), spec))
    scheduled = [r.scheduled_s - result.run_start_s for r in result.records]
    assert scheduled == pytest.approx([0.0, 0.01, 0.02, 0.03, 0.04])
    for r in result.records:  # never early; late only by scheduler jitter (loose: shared CI)
        assert 0.0 <= r.start_s - r.scheduled_s < 0.05
    assert result.duration_s >= 0.04


def test_client_exceptions_become_client_error_records():
    result = asyncio.run(run_once(BrokenClient(), _requests(3), ArrivalSpec()))
    assert {r.status_code for r in result.records} == {"CLIENT_ERROR"}
    assert "bug in client" in result.records[0].error


def test_progress_postfix_moves_with_tokens_before_any_request_finishes():
    stream = io.StringIO()
    bar = LiveProgress(4, stream, label="rate 2", min_interval_s=0.0)
    bar.interval_s = 0.0  # a StringIO is no terminal: redraw on every message anyway
    bar.on_tokens(start_s=1.0, prev_s=None, now_s=1.010, num=1)  # TTFT 10 ms
    bar.on_tokens(start_s=1.0, prev_s=1.010, now_s=1.016, num=2)  # 3 ms per token
    assert "TTFT=10.0ms" in bar.postfix() and "TPOT=3.00ms" in bar.postfix()
    assert "ok=0 fail=0 TTFT=10.0ms TPOT=3.00ms" in stream.getvalue()  # drawn, none done
    bar.on_tokens(start_s=2.0, prev_s=None, now_s=2.030, num=3)  # TTFT 30; 2 later tokens
    assert "TTFT=20.0ms" in bar.postfix() and "TPOT=1.50ms" in bar.postfix()
    for ok in (True, True, False, True):
        bar.advance(ok)
    bar.close()
    last = stream.getvalue().split("\r")[-1]
    assert last.startswith("rate 2: 100%") and "4/4" in last and "ok=3 fail=1" in last


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_loadtest_args(parser)
    return parser.parse_args(list(argv))


def test_cli_sweep_writes_json_jsonl_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    client = FakeClient(delay_s=0.001)
    out, err = io.StringIO(), io.StringIO()
    args = _args(
        "--num-prompts",
        "10",
        "--random-input-len",
        "6",
        "--random-output-len",
        "4",
        "--sweep-rates",
        "200,inf",
        "--num-warmups",
        "2",
        "--goodput",
        "ttft:1000",
        "--result-json",
        str(tmp_path / "r.json"),
        "--per-request-jsonl",
        str(tmp_path / "r.jsonl"),
        "--plot",
        str(tmp_path / "r.png"),
        "--metric-percentiles",
        "50,99.9",
    )
    assert run_loadtest(args, client_factory=lambda opts: client, out=out, err=err) == 0
    runs = json.loads((tmp_path / "r.json").read_text())
    assert [r["request_rate"] for r in runs] == [200.0, "inf"]
    for run in runs:
        assert (run["completed"], run["failed"]) == (9, 1)
        assert run["failed_by_status"] == {"RESOURCE_EXHAUSTED": 1}
        assert run["total_output_tokens"] == 36
        assert run["num_good_requests"] == 9
        assert {"p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "p99.9_ttft_ms"} <= run.keys()
    assert len(client.seen) == 2 + 2 * 10
    assert all(max(r.prompt_token_ids) < 777 for r in client.seen)  # vocab from GetModelInfo
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert len(lines) == 20 and json.loads(lines[7])["status_code"] == "RESOURCE_EXHAUSTED"
    assert (tmp_path / "r.png").stat().st_size > 1000
    text = out.getvalue()
    assert text.count("Serving Benchmark Result") == 2 and "Rate Sweep" in text
    assert "RESOURCE_EXHAUSTED:" in text
    assert "warm-up" in err.getvalue() and "rate 200: 100%" in err.getvalue()
    assert "TTFT=" in err.getvalue() and "TPOT=" in err.getvalue()


def test_cli_bad_flags_exit_2_and_all_failed_exit_1(tmp_path):
    err = io.StringIO()
    args = _args("--dataset-name", "trace")
    assert run_loadtest(args, client_factory=lambda o: FakeClient(), err=err) == 2
    assert "--dataset-path" in err.getvalue()
    args = _args("--goodput", "itl:5")
    assert run_loadtest(args, client_factory=lambda o: FakeClient(), err=io.StringIO()) == 2
    args = _args("--num-prompts", "2", "--no-progress", "--vocab-size", "50")
    code = run_loadtest(args, lambda o: BrokenClient(), out=io.StringIO(), err=io.StringIO())
    assert code == 1


def test_main_help_and_rate_parsing(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "--max-concurrency" in capsys.readouterr().out
    assert math.isinf(_args().request_rate)
    with pytest.raises(SystemExit):
        _args("--request-rate", "-1")
