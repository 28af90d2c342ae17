"""Turning results into text: the console table, the summary JSON, and per-request JSONL.

Summary JSON keys follow `vllm bench serve` (`duration`, `completed`, `request_throughput`,
`mean_ttft_ms`, `p99_itl_ms`, ...). A single run writes one JSON object; a sweep writes a JSON
list with one object per rate. `request_rate` is the string "inf" for a burst (JSON has no inf);
statistics without samples are null. SCHEMA_VERSION changes whenever a key changes meaning.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

from loadgen.client import RequestRecord
from loadgen.metrics import METRIC_NAMES, METRIC_TITLES, RunSummary, request_latency

SCHEMA_VERSION = 2
METRIC_DEFINITIONS = {
    "ttft": "time from sending the request to the first message carrying a token",
    "tpot": "per request (e2el - ttft) / (output_tokens - 1), requests with >1 output token; "
    "stats over requests",
    "itl": "gap between consecutive token-carrying messages, pooled over requests; a message "
    "with several tokens (speculative decoding) counts as one gap",
    "e2el": "time from sending the request to the end of its stream",
    "percentiles": "numpy linear interpolation; std is population std (ddof=0)",
}


METRIC_FOOTNOTE = (
    "TPOT = (E2EL - TTFT) / (output_tokens - 1) per request, averaged over requests.\n"
    "ITL = gap between consecutive token-carrying messages, pooled; a message with\n"
    "several tokens (speculative decoding) is one gap. Percentiles: numpy linear."
)
EXAMPLE_CHARS = 120  # a failure's example message in the table: one line, cut to this


@dataclass(frozen=True)
class RunInfo:
    """How a run was configured, echoed into every summary object."""

    target: str
    dataset_name: str
    num_prompts: int
    request_rate_mode: str
    burstiness: float
    seed: int
    num_warmups: int
    percentile_metrics: tuple[str, ...] = METRIC_NAMES
    label: str = "dsv4-loadtest"
    backend: str = "grpc"
    model_id: str = ""
    tokenizer_id: str = ""


def rate_for_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def percentile_key(p: float) -> str:
    return f"p{p:g}"


def summary_to_json(summary: RunSummary, info: RunInfo) -> dict[str, Any]:
    """The flat, vLLM-named summary object for one run."""
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "label": info.label,
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "backend": info.backend,
        "model_id": info.model_id,
        "tokenizer_id": info.tokenizer_id,
        "target": info.target,
        "dataset_name": info.dataset_name,
        "num_prompts": info.num_prompts,
        "request_rate": rate_for_json(summary.request_rate),
        "request_rate_mode": info.request_rate_mode,
        "burstiness": info.burstiness,
        "max_concurrency": summary.max_concurrency,
        "seed": info.seed,
        "num_warmups": info.num_warmups,
        "duration": summary.duration_s,
        "completed": summary.completed,
        "failed": summary.failed,
        "failed_by_status": dict(summary.failed_by_status),
        "total_input_tokens": summary.total_input_tokens,
        "total_output_tokens": summary.total_output_tokens,
        "request_throughput": summary.request_throughput,
        "request_goodput": summary.request_goodput,
        "num_good_requests": summary.num_good_requests,
        "goodput_slos_ms": dict(summary.goodput_slos_ms),
        "input_throughput": summary.input_throughput,
        "output_throughput": summary.output_throughput,
        "total_token_throughput": summary.total_token_throughput,
        "max_output_tokens_per_s": summary.max_output_tokens_per_s,
        "max_concurrent_requests": summary.max_concurrent_requests,
        "mean_tokens_per_chunk": summary.mean_tokens_per_chunk,
        "num_server_usage_reports": summary.server.num_with_usage,
        "num_token_count_mismatches": summary.server.num_token_count_mismatches,
        "num_prefill_retries": summary.server.num_prefill_retries,
        "num_prefill_recomputed": summary.server.num_prefill_recomputed,
        "spec_decode_acceptance_rate": summary.server.spec_decode_acceptance_rate,
        "percentiles": list(summary.percentiles),
    }
    for metric, stats in summary.stats:
        out[f"mean_{metric}_ms"] = stats.mean_ms
        out[f"median_{metric}_ms"] = stats.median_ms
        out[f"std_{metric}_ms"] = stats.std_ms
        if metric in info.percentile_metrics:
            for p, value in stats.percentiles_ms:
                out[f"{percentile_key(p)}_{metric}_ms"] = value
    out["metric_definitions"] = METRIC_DEFINITIONS
    return out


def write_result_json(path: str, objects: Sequence[dict[str, Any]], is_sweep: bool) -> None:
    """One object for a single run, a list of objects for a sweep."""
    payload: Any = list(objects) if is_sweep else objects[0]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")


def request_to_json(record: RequestRecord, run_start_s: float, request_rate: float) -> dict:
    """One per-request JSONL object; times are seconds since the run started."""
    lat = request_latency(record)
    rel = run_start_s
    return {
        "request_id": record.request_id,
        "request_rate": rate_for_json(request_rate),
        "status_code": record.status_code,
        "error": record.error,
        "finish_reason": record.finish_reason,
        "input_tokens": record.num_input_tokens,
        "output_tokens": record.num_output_tokens,
        "requested_output_tokens": record.requested_output_len,
        "server_usage": dataclasses.asdict(record.usage) if record.usage else None,
        "scheduled_s": None if record.scheduled_s is None else record.scheduled_s - rel,
        "start_s": record.start_s - rel,
        "end_s": record.end_s - rel,
        "ttft_ms": lat.ttft_ms if lat else None,
        "tpot_ms": lat.tpot_ms if lat else None,
        "e2el_ms": lat.e2el_ms if lat else None,
        "itl_ms": list(lat.itls_ms) if lat else [],
        "chunk_num_tokens": list(record.chunk_num_tokens),
    }


def write_per_request_jsonl(
    stream: IO[str], records: Sequence[RequestRecord], run_start_s: float, request_rate: float
) -> None:
    for record in records:
        stream.write(json.dumps(request_to_json(record, run_start_s, request_rate)) + "\n")


def one_line(message: str, limit: int = EXAMPLE_CHARS) -> str:
    """`message` on one line (whitespace runs collapsed), cut to `limit` characters."""
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def format_summary_table(summary: RunSummary, info: RunInfo) -> str:
    """The console block, laid out like vLLM's "Serving Benchmark Result"."""
    w = 50
    lines = [" Serving Benchmark Result ".center(w, "=")]

    def row(name: str, value: object) -> None:
        lines.append(f"{name:<40}{value!s:<10}")

    rate = summary.request_rate
    row("Successful requests:", summary.completed)
    row("Failed requests:", summary.failed)
    examples = dict(summary.failed_examples)
    for code, count in summary.failed_by_status:
        row(f"  {code}:", count)
        if code in examples:  # what the server said, so the user sees what to fix
            lines.append(f"    e.g. {one_line(examples[code])}")
    row("Request rate configured (RPS):", "inf" if math.isinf(rate) else f"{rate:.2f}")
    row("Maximum request concurrency:", summary.max_concurrency or "none")
    row("Benchmark duration (s):", _fmt(summary.duration_s))
    row("Total input tokens:", summary.total_input_tokens)
    row("Total generated tokens:", summary.total_output_tokens)
    row("Request throughput (req/s):", _fmt(summary.request_throughput))
    if summary.request_goodput is not None:
        row("Request goodput (req/s):", _fmt(summary.request_goodput))
    row("Output token throughput (tok/s):", _fmt(summary.output_throughput))
    row("Peak output token throughput (tok/s):", _fmt(summary.max_output_tokens_per_s))
    row("Peak concurrent requests:", summary.max_concurrent_requests)
    row("Total token throughput (tok/s):", _fmt(summary.total_token_throughput))
    row("Mean tokens per streamed message:", _fmt(summary.mean_tokens_per_chunk))
    server = summary.server
    if server.num_with_usage:
        row("Server/client token count mismatches:", server.num_token_count_mismatches)
        row(
            "Prefill retries / recomputed:",
            f"{server.num_prefill_retries} / {server.num_prefill_recomputed}",
        )
        if server.spec_decode_acceptance_rate is not None:
            row("Spec-decode acceptance rate:", _fmt(server.spec_decode_acceptance_rate, 3))
    for metric, stats in summary.stats:
        name = metric.upper()
        lines.append(f" {METRIC_TITLES[metric]} ".center(w, "-"))
        row(f"Mean {name} (ms):", _fmt(stats.mean_ms))
        row(f"Median {name} (ms):", _fmt(stats.median_ms))
        row(f"Std {name} (ms):", _fmt(stats.std_ms))
        if metric in info.percentile_metrics:
            for p, value in stats.percentiles_ms:
                row(f"P{p:g} {name} (ms):", _fmt(value))
    lines.append("=" * w)
    return "\n".join(lines)


def format_sweep_table(summaries: Sequence[RunSummary]) -> str:
    """One line per rate: the numbers a sweep is read for."""
    head = (
        f"{'rate':>8} {'ok':>6} {'fail':>5} {'req/s':>8} {'good/s':>8} {'out tok/s':>10} "
        f"{'p99 TTFT':>9} {'p99 TPOT':>9} {'p99 ITL':>8}"
    )
    lines = [" Rate Sweep ".center(len(head), "="), head]
    for s in summaries:
        p99 = {m: dict(s.stat(m).percentiles_ms).get(99.0) for m in ("ttft", "tpot", "itl")}
        rate = "inf" if math.isinf(s.request_rate) else f"{s.request_rate:g}"
        lines.append(
            f"{rate:>8} {s.completed:>6} {s.failed:>5} {_fmt(s.request_throughput):>8} "
            f"{_fmt(s.request_goodput):>8} {_fmt(s.output_throughput, 1):>10} "
            f"{_fmt(p99['ttft'], 1):>9} {_fmt(p99['tpot'], 1):>9} {_fmt(p99['itl'], 1):>8}"
        )
    return "\n".join(lines)
