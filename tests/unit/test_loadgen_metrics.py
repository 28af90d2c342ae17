"""Metric math on synthetic timestamps; every expected number is worked out by hand below.

Times are dyadic fractions of a second (0.125 s = 125 ms exactly) so float equality is safe.

Successful requests (send time, token-carrying messages as (time, tokens), end of stream):
  A: sent 0,      (0.125, 1) (0.1875, 1) (0.25, 2), end 0.3125 -> 4 tokens
     TTFT 125, E2EL 312.5, TPOT (312.5-125)/3 = 62.5, ITL 62.5, 62.5
  B: sent 0,      (0.25, 1) (0.375, 1), end 0.5                 -> 2 tokens
     TTFT 250, E2EL 500, TPOT (500-250)/1 = 250, ITL 125
  C: sent 0.0625, (0.4375, 1), end 0.4375                       -> 1 token
     TTFT 375, E2EL 375, no TPOT (one token), no ITL
Failed: D, F RESOURCE_EXHAUSTED; E INVALID_ARGUMENT (all sent 0, ended 0.0625).

Percentiles are numpy-linear: for sorted x of length n, p -> x[i] + f*(x[i+1]-x[i]) with
i + f = p/100*(n-1).
  TTFT [125,250,375]: mean 250, median 250, std 125*sqrt(2/3), p90 = 250+0.8*125 = 350,
       p99 = 250+0.98*125 = 372.5
  TPOT [62.5,250]: mean = median = 156.25, std 93.75, p90 = 62.5+0.9*187.5 = 231.25
  ITL  [62.5,62.5,125]: mean 250/3, median 62.5, p90 = 62.5+0.8*62.5 = 112.5
  E2EL [312.5,375,500]: mean 1187.5/3, median 375, p90 = 375+0.8*125 = 475
Duration 2 s; input lens A 10, B 20, C 30 -> 60 input, 7 output tokens;
request throughput 3/2 = 1.5, output 7/2 = 3.5, total 67/2 = 33.5 tok/s.
Peak concurrency: at t=0 A, B, D, E, F are in flight -> 5. Peak tokens in one second: 7.
Tokens per message: 7 tokens / 6 messages.
"""

from __future__ import annotations

import math

import pytest

from dsv4.types import Usage
from loadgen.client import STATUS_EMPTY_RESPONSE, RequestRecord
from loadgen.metrics import GoodputSLO, parse_goodput, request_latency, summarize


def _ok(rid: str, start: float, chunks: list[tuple[float, int]], end: float, in_len: int):
    return RequestRecord(
        request_id=rid,
        input_len=in_len,
        requested_output_len=sum(n for _, n in chunks),
        start_s=start,
        end_s=end,
        chunk_times_s=tuple(t for t, _ in chunks),
        chunk_num_tokens=tuple(n for _, n in chunks),
    )


def _failed(rid: str, code: str) -> RequestRecord:
    return RequestRecord(rid, 5, 4, 0.0, 0.0625, status_code=code, error="nope")


RECORDS = [
    _ok("A", 0.0, [(0.125, 1), (0.1875, 1), (0.25, 2)], 0.3125, 10),
    _ok("B", 0.0, [(0.25, 1), (0.375, 1)], 0.5, 20),
    _ok("C", 0.0625, [(0.4375, 1)], 0.4375, 30),
    _failed("D", "RESOURCE_EXHAUSTED"),
    _failed("E", "INVALID_ARGUMENT"),
    _failed("F", "RESOURCE_EXHAUSTED"),
]


def _summary(goodput: GoodputSLO | None = None):
    return summarize(RECORDS, 2.0, 0.0, 4.0, None, (50, 90, 99), goodput)


def test_per_request_latencies():
    a = request_latency(RECORDS[0])
    assert (a.ttft_ms, a.e2el_ms, a.tpot_ms, a.itls_ms) == (125.0, 312.5, 62.5, (62.5, 62.5))
    c = request_latency(RECORDS[2])
    assert (c.ttft_ms, c.e2el_ms, c.tpot_ms, c.itls_ms) == (375.0, 375.0, None, ())
    assert request_latency(RECORDS[3]) is None


def test_latency_statistics():
    s = _summary()
    ttft, tpot, itl, e2el = (s.stat(m) for m in ("ttft", "tpot", "itl", "e2el"))
    assert (ttft.mean_ms, ttft.median_ms) == (250.0, 250.0)
    assert ttft.std_ms == pytest.approx(125 * math.sqrt(2 / 3))
    assert dict(ttft.percentiles_ms) == pytest.approx({50.0: 250.0, 90.0: 350.0, 99.0: 372.5})
    assert (tpot.mean_ms, tpot.median_ms, tpot.std_ms) == (156.25, 156.25, 93.75)
    assert dict(tpot.percentiles_ms)[90.0] == pytest.approx(231.25)
    assert tpot.num_samples == 2  # C has one token: no TPOT
    assert itl.mean_ms == pytest.approx(250 / 3)
    assert itl.median_ms == 62.5
    assert dict(itl.percentiles_ms)[90.0] == pytest.approx(112.5)
    assert itl.num_samples == 3  # A's 2-token message is one gap, not two
    assert e2el.mean_ms == pytest.approx(1187.5 / 3)
    assert e2el.median_ms == 375.0
    assert dict(e2el.percentiles_ms)[90.0] == pytest.approx(475.0)


def test_counts_and_throughput():
    s = _summary()
    assert (s.completed, s.failed) == (3, 3)
    assert dict(s.failed_by_status) == {"RESOURCE_EXHAUSTED": 2, "INVALID_ARGUMENT": 1}
    assert (s.total_input_tokens, s.total_output_tokens) == (60, 7)
    assert s.request_throughput == 1.5
    assert s.input_throughput == 30.0
    assert s.output_throughput == 3.5
    assert s.total_token_throughput == 33.5
    assert s.max_concurrent_requests == 5
    assert s.max_output_tokens_per_s == 7.0
    assert s.mean_tokens_per_chunk == pytest.approx(7 / 6)
    assert s.request_goodput is None and s.num_good_requests is None


@pytest.mark.parametrize(
    ("items", "num_good"),
    [
        (["ttft:300", "tpot:100"], 1),  # A only: B's TPOT 250, C's TTFT 375
        (["e2el:375"], 2),  # A 312.5 and C 375 (limit inclusive); B 500
        (["tpot:100"], 2),  # A 62.5; C counts as TPOT 0 (one token), as in vLLM
        (["ttft:1000", "tpot:1000", "e2el:1000"], 3),
    ],
)
def test_goodput(items, num_good):
    s = _summary(parse_goodput(items))
    assert s.num_good_requests == num_good
    assert s.request_goodput == num_good / 2.0


def test_parse_goodput_rejects_bad_items():
    assert parse_goodput(["ttft:500", "e2el:2000"]) == GoodputSLO(ttft_ms=500, e2el_ms=2000)
    for bad in (["itl:5"], ["ttft"], ["ttft:abc"], ["tpot:0"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_empty_and_all_failed_runs_do_not_crash():
    s = summarize([_failed("X", "UNAVAILABLE")], 1.0, 0.0, math.inf)
    assert (s.completed, s.failed, dict(s.failed_by_status)) == (0, 1, {"UNAVAILABLE": 1})
    assert s.stat("ttft").mean_ms is None
    assert dict(s.stat("itl").percentiles_ms)[99.0] is None
    empty = summarize([], 0.0, 0.0, 1.0)
    assert (empty.completed, empty.request_throughput) == (0, 0.0)


def test_ok_status_without_tokens_counts_as_empty_response():
    odd = RequestRecord("Z", 3, 3, 0.0, 0.1)  # OK but nothing streamed
    s = summarize([odd], 1.0, 0.0, 1.0)
    assert dict(s.failed_by_status) == {STATUS_EMPTY_RESPONSE: 1}


def test_server_usage_totals_and_input_tokens_prefer_server_count():
    usage = Usage(
        prompt_tokens=11, completion_tokens=4, num_draft_tokens=6, num_accepted_draft_tokens=3
    )
    a = RECORDS[0]
    a_with_usage = RequestRecord(**{**a.__dict__, "usage": usage})
    b_mismatch = RequestRecord(**{**RECORDS[1].__dict__, "usage": Usage(20, 5)})
    s = summarize([a_with_usage, b_mismatch], 1.0, 0.0, 1.0)
    assert s.total_input_tokens == 11 + 20
    assert s.server.num_with_usage == 2
    assert s.server.num_token_count_mismatches == 1  # B streamed 2, server said 5
    assert s.server.spec_decode_acceptance_rate == 0.5
