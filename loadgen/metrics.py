"""Serving metrics with `vllm bench serve`'s names and formulas.

Per successful request (times in ms, t_k = arrival of the k-th message carrying tokens):
- TTFT = t_1 - send time.
- E2EL = end of stream - send time.
- TPOT = (E2EL - TTFT) / (output_tokens - 1), only for requests with more than one output token;
  the TPOT statistics are over these per-request values (each request weighs the same).
- ITL = t_{k+1} - t_k for every pair of consecutive token-carrying messages, pooled over all
  requests. A message may carry several tokens (speculative decoding): it still yields ONE gap,
  not divided by its token count, so ITL measures time between chunks and TPOT time per token.

Percentiles use numpy's default linear interpolation (as vLLM); std is the population std
(ddof = 0). Failed requests are excluded from latency statistics and token totals and are
counted by status code. Goodput counts successful requests meeting every given SLO (a request
with one output token has TPOT 0 for this purpose, as in vLLM), divided by the run duration.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loadgen.client import STATUS_EMPTY_RESPONSE, RequestRecord

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class GoodputSLO:
    """Latency ceilings in ms; None means no constraint on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def is_met(self, ttft_ms: float, tpot_ms: float, e2el_ms: float) -> bool:
        pairs = ((ttft_ms, self.ttft_ms), (tpot_ms, self.tpot_ms), (e2el_ms, self.e2el_ms))
        return all(limit is None or value <= limit for value, limit in pairs)

    def as_dict(self) -> dict[str, float]:
        pairs = (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2el", self.e2el_ms))
        return {k: v for k, v in pairs if v is not None}


def parse_goodput(items: Sequence[str]) -> GoodputSLO:
    """Parse `ttft:500 tpot:50 e2el:2000` (ms). Raises ValueError naming the bad item."""
    values: dict[str, float] = {}
    for item in items:
        key, sep, raw = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"goodput item {item!r}: expected KEY:MS with KEY in {GOODPUT_KEYS}")
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"goodput item {item!r}: {raw!r} is not a number of ms") from None
        if not value > 0:
            raise ValueError(f"goodput item {item!r}: the limit must be > 0 ms")
        values[f"{key}_ms"] = value
    return GoodputSLO(**values)


@dataclass(frozen=True)
class RequestLatency:
    """Latencies of one successful request, in ms. `tpot_ms` is None for one output token."""

    ttft_ms: float
    e2el_ms: float
    tpot_ms: float | None
    itls_ms: tuple[float, ...]


def request_latency(record: RequestRecord) -> RequestLatency | None:
    """Latencies of a successful record with at least one token, else None."""
    if not record.is_success or not record.chunk_times_s:
        return None
    ttft_ms = (record.chunk_times_s[0] - record.start_s) * 1000.0
    e2el_ms = (record.end_s - record.start_s) * 1000.0
    n_out = record.num_output_tokens
    tpot_ms = (e2el_ms - ttft_ms) / (n_out - 1) if n_out > 1 else None
    times = record.chunk_times_s
    itls_ms = tuple((b - a) * 1000.0 for a, b in itertools.pairwise(times))
    return RequestLatency(ttft_ms, e2el_ms, tpot_ms, itls_ms)


@dataclass(frozen=True)
class MetricStats:
    """Summary of one metric in ms; all None when there were no samples."""

    mean_ms: float | None
    median_ms: float | None
    std_ms: float | None
    percentiles_ms: tuple[tuple[float, float | None], ...]
    num_samples: int


def metric_stats(samples_ms: Sequence[float], percentiles: Sequence[float]) -> MetricStats:
    """Mean, median, population std and linear-interpolated percentiles of `samples_ms`."""
    if not samples_ms:
        return MetricStats(None, None, None, tuple((p, None) for p in percentiles), 0)
    arr = np.asarray(samples_ms, dtype=np.float64)
    pcts = tuple((float(p), float(np.percentile(arr, p))) for p in percentiles)
    return MetricStats(
        float(arr.mean()), float(np.median(arr)), float(arr.std()), pcts, int(arr.size)
    )


@dataclass(frozen=True)
class RunSummary:
    """Aggregate result of one run (one request rate)."""

    request_rate: float
    max_concurrency: int | None
    duration_s: float
    completed: int
    failed: int
    failed_by_status: tuple[tuple[str, int], ...]
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None
    num_good_requests: int | None
    goodput_slos_ms: tuple[tuple[str, float], ...]
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    mean_tokens_per_chunk: float | None
    server: ServerTotals
    percentiles: tuple[float, ...]
    stats: tuple[tuple[str, MetricStats], ...]
    # (status code, the first failed request's error message) per code with a message
    failed_examples: tuple[tuple[str, str], ...] = ()

    def stat(self, metric: str) -> MetricStats:
        return dict(self.stats)[metric]


@dataclass(frozen=True)
class ServerTotals:
    """Sums of what the server reported in `usage` over successful requests."""

    num_with_usage: int = 0
    num_token_count_mismatches: int = 0  # usage.completion_tokens != tokens streamed
    num_prefill_retries: int = 0
    num_prefill_recomputed: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

    @property
    def spec_decode_acceptance_rate(self) -> float | None:
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_draft_tokens / self.num_draft_tokens


def server_totals(records: Sequence[RequestRecord]) -> ServerTotals:
    """Aggregate the server's `usage` over successful records that carry one."""
    usages = [(r, r.usage) for r in records if r.is_success and r.usage is not None]
    return ServerTotals(
        num_with_usage=len(usages),
        num_token_count_mismatches=sum(
            u.completion_tokens != r.num_output_tokens for r, u in usages
        ),
        num_prefill_retries=sum(u.num_prefill_retries for _, u in usages),
        num_prefill_recomputed=sum(u.prefill_was_recomputed for _, u in usages),
        num_draft_tokens=sum(u.num_draft_tokens for _, u in usages),
        num_accepted_draft_tokens=sum(u.num_accepted_draft_tokens for _, u in usages),
    )


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """Largest number of requests in flight at once (ends sort before starts at equal times)."""
    events = sorted([(r.start_s, 1) for r in records] + [(r.end_s, -1) for r in records])
    peak = in_flight = 0
    for _, delta in events:
        in_flight += delta
        peak = max(peak, in_flight)
    return peak


def peak_output_tokens_per_s(records: Sequence[RequestRecord], run_start_s: float) -> float:
    """Most output tokens that arrived within one 1-second bucket since `run_start_s`."""
    buckets: Counter[int] = Counter()
    for r in records:
        if r.is_success:
            for t, n in zip(r.chunk_times_s, r.chunk_num_tokens):
                buckets[math.floor(t - run_start_s)] += n
    return float(max(buckets.values(), default=0))


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    run_start_s: float,
    request_rate: float,
    max_concurrency: int | None = None,
    percentiles: Sequence[float] = (50.0, 90.0, 99.0),
    goodput: GoodputSLO | None = None,
) -> RunSummary:
    """Aggregate `records` of one run lasting `duration_s` into a `RunSummary`."""
    ok = [(r, lat) for r in records if (lat := request_latency(r)) is not None]
    failed_records = [r for r in records if request_latency(r) is None]
    codes = [STATUS_EMPTY_RESPONSE if r.is_success else r.status_code for r in failed_records]
    failed = Counter(codes)
    examples: dict[str, str] = {}
    for code, r in zip(codes, failed_records):
        if r.error:
            examples.setdefault(code, r.error)
    in_tokens = sum(r.num_input_tokens for r, _ in ok)
    out_tokens = sum(r.num_output_tokens for r, _ in ok)
    samples = {
        "ttft": [lat.ttft_ms for _, lat in ok],
        "tpot": [lat.tpot_ms for _, lat in ok if lat.tpot_ms is not None],
        "itl": [itl for _, lat in ok for itl in lat.itls_ms],
        "e2el": [lat.e2el_ms for _, lat in ok],
    }
    num_good = None
    if goodput is not None and goodput.is_set:
        num_good = sum(
            goodput.is_met(lat.ttft_ms, lat.tpot_ms or 0.0, lat.e2el_ms) for _, lat in ok
        )
    num_chunks = sum(len(r.chunk_num_tokens) for r, _ in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return RunSummary(
        request_rate=request_rate,
        max_concurrency=max_concurrency,
        duration_s=duration_s,
        completed=len(ok),
        failed=sum(failed.values()),
        failed_by_status=tuple(sorted(failed.items())),
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        request_throughput=len(ok) * per_s,
        input_throughput=in_tokens * per_s,
        output_throughput=out_tokens * per_s,
        total_token_throughput=(in_tokens + out_tokens) * per_s,
        request_goodput=None if num_good is None else num_good * per_s,
        num_good_requests=num_good,
        goodput_slos_ms=tuple(goodput.as_dict().items()) if goodput else (),
        max_output_tokens_per_s=peak_output_tokens_per_s(records, run_start_s),
        max_concurrent_requests=peak_concurrency(records),
        mean_tokens_per_chunk=out_tokens / num_chunks if num_chunks else None,
        server=server_totals(records),
        percentiles=tuple(float(p) for p in percentiles),
        stats=tuple((m, metric_stats(samples[m], percentiles)) for m in METRIC_NAMES),
        failed_examples=tuple(sorted(examples.items())),
    )
