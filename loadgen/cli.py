"""`dsv4 loadtest` / `python -m loadgen`: flags modelled on `vllm bench serve` (its spellings
work too: `--backend openai|openai-chat`, `--base-url`, `--host/--port`, `--endpoint`,
`--model`, `--save-result`, `--result-dir/--result-filename`, `--disable-tqdm`).

Exit status: 0 when the run(s) finished and at least one request succeeded, 1 when every
request failed (each failure is still counted by status code and reported), 2 for bad flags,
unreadable dataset files or a target where nothing answers (checked before the first request,
one line). Server errors never raise.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from loadgen.arrivals import ARRIVAL_MODES
from loadgen.client import BACKEND_ALIASES, BACKENDS, ClientOptions, ModelInfoView, make_client
from loadgen.config import (
    DATASET_NAMES,
    LoadtestConfig,
    LoadtestConfigError,
    WorkloadSpec,
    build_requests,
    config_from_args,
    rate_from_text,
)
from loadgen.datasets import load_tokenizer
from loadgen.metrics import RunSummary, summarize
from loadgen.progress import LiveProgress
from loadgen.report import (
    METRIC_FOOTNOTE,
    RunInfo,
    format_summary_table,
    format_sweep_table,
    summary_to_json,
    write_per_request_jsonl,
    write_result_json,
)
from loadgen.runner import RunResult, run_once, run_warmups
from loadgen.workloads import DEFAULT_VOCAB_SIZE

ClientFactory = Callable[[ClientOptions], Any]
IN_FLIGHT_WARNING_THRESHOLD = 1000


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
        return value

    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number >= 0")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text} must be a positive finite number")
    return value


def add_loadtest_args(parser: argparse.ArgumentParser) -> None:
    """Add every `dsv4 loadtest` flag to `parser`."""
    g = parser.add_argument_group("target")
    g.add_argument(
        "--backend", choices=(*BACKENDS, *BACKEND_ALIASES), default="grpc",
        help="grpc: dsv4.v1.Router; openai / openai-chat: /v1/completions / "
        "/v1/chat/completions of any OpenAI-compatible server (vllm = openai)",
    )  # fmt: skip
    g.add_argument("--target", default=None, help="HOST:PORT (default 127.0.0.1:50051; HTTP :8000)")
    g.add_argument("--host", default=None, help="vLLM's spelling: server host (with --port)")
    g.add_argument("--port", type=int, default=None, help="vLLM's spelling: server port")
    g.add_argument("--base-url", default=None, help="http(s)://HOST:PORT[/prefix] (HTTP backends)")
    g.add_argument("--endpoint", default=None, help="HTTP path (default /v1/completions or chat)")
    g.add_argument("--model", default=None, help="model id (default: the server's first model)")
    g.add_argument("--served-model-name", default=None, help="name sent in requests if not --model")
    g.add_argument("--tls-ca", default=None, metavar="FILE", help="root CA (PEM): use TLS")
    g.add_argument("--api-key", default=None, help="sent as `authorization: Bearer KEY`")
    g.add_argument("--timeout-s", type=positive_float, default=600.0, help="per-request deadline")
    g.add_argument(
        "--vocab-size",
        type=positive_int,
        default=None,
        help="default: ask GetModelInfo, else 129280",
    )
    g.add_argument("--temperature", type=non_negative_float, default=None, help="default: server's")
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the requested output length (default on)",
    )
    d = parser.add_argument_group("workload")
    d.add_argument("--dataset-name", choices=DATASET_NAMES, default="random")
    d.add_argument("--dataset-path", default=None, help="ShareGPT JSON or Mooncake JSONL")
    d.add_argument("--num-prompts", type=positive_int, default=1000)
    d.add_argument(
        "--random-input-len", type=positive_int, default=1024, help="also shared-prefix suffix"
    )
    d.add_argument("--random-output-len", type=positive_int, default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths in mean*(1±r)")
    d.add_argument(
        "--prefix-len", type=non_negative_int, default=512, help="shared-prefix: prefix tokens"
    )
    d.add_argument(
        "--prefix-num-groups", type=positive_int, default=4, help="shared-prefix: groups"
    )
    d.add_argument(
        "--sharegpt-output-len", type=positive_int, default=None, help="fixed output length"
    )
    d.add_argument(
        "--tokenizer", default=None,
        help="tokenizer.json or its dir: exact ShareGPT lengths, chat prompt text, vocab size",
    )  # fmt: skip
    d.add_argument(
        "--trace-block-size", type=positive_int, default=512, help="tokens per trace hash id"
    )
    d.add_argument("--trace-time-scale", type=float, default=1.0, help="0.5 = replay 2x faster")
    d.add_argument(
        "--trace-timestamps",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replay trace timestamps (off: use --request-rate)",
    )
    a = parser.add_argument_group("load")
    a.add_argument("--request-rate", type=rate_from_text, default=math.inf, help="req/s or inf")
    a.add_argument("--request-rate-mode", choices=ARRIVAL_MODES, default="poisson")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    a.add_argument("--max-concurrency", type=positive_int, default=None)
    a.add_argument("--num-warmups", type=non_negative_int, default=0)
    a.add_argument("--seed", type=non_negative_int, default=0)
    a.add_argument("--sweep-rates", default=None, metavar="R1,R2,..", help="one run per rate")
    o = parser.add_argument_group("output")
    o.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    o.add_argument(
        "--metric-percentiles", "--percentiles", default="90,99", help="p90, p99 always included"
    )
    o.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="ttft/tpot/e2el")
    o.add_argument("--result-json", default=None, metavar="FILE")
    o.add_argument("--save-result", action="store_true", help="vLLM's: JSON into --result-dir")
    o.add_argument("--result-dir", default=".", help="with --save-result")
    o.add_argument("--result-filename", default=None, help="default BACKEND-RATEqps-MODEL-DATE")
    o.add_argument("--per-request-jsonl", default=None, metavar="FILE")
    o.add_argument("--plot", default=None, metavar="FILE.png", help="CDFs; sweeps: Pareto")
    o.add_argument(
        "--no-progress", "--disable-tqdm", action="store_true", help="no progress bar on stderr"
    )
    o.add_argument("--label", default="dsv4-loadtest")


def _resolve_vocab_size(config: LoadtestConfig, info: ModelInfoView | None, err: IO[str]) -> int:
    if config.vocab_size is not None:
        return config.vocab_size
    if info is not None and info.vocab_size > 0:
        return int(info.vocab_size)
    if config.workload.tokenizer_path:
        return int(load_tokenizer(config.workload.tokenizer_path).get_vocab_size())
    err.write(
        f"loadtest: the server did not say its vocabulary size: --vocab-size {DEFAULT_VOCAB_SIZE}\n"
    )
    return DEFAULT_VOCAB_SIZE


async def _model_info(config: LoadtestConfig, client: Any) -> ModelInfoView | None:
    """Fail fast when nothing answers; then what the server says about its model."""
    check = getattr(client, "check_reachable", None)
    if check is not None:
        await check()
    fetch = getattr(client, "fetch_model_info", None)
    info = await fetch() if fetch is not None else None
    if config.client.backend != "grpc" and not (config.client.model or info):
        raise LoadtestConfigError(
            f"the server at {config.client.target} lists no model: pass --model NAME"
        )
    return info


def _check_lengths(wl: WorkloadSpec, max_model_len: int) -> None:
    """A synthetic workload whose every request is longer than the server's context is refused
    before its prompts are drawn: the server would refuse each one, and prompts of 10**8
    tokens took minutes and gigabytes to draw (the run looked hung)."""
    if wl.dataset_name not in ("random", "shared-prefix"):
        return
    prefix = wl.prefix_len if wl.dataset_name == "shared-prefix" else 0
    shortest = prefix + wl.input_len.low + wl.output_len.low
    if shortest > max_model_len:
        flags = f"--prefix-len {prefix} / " if prefix else ""
        flags += (
            f"--random-input-len {wl.input_len.mean} / --random-output-len {wl.output_len.mean}"
        )
        raise LoadtestConfigError(
            f"{flags}: every request has at least {shortest} tokens (prompt + output), more "
            f"than the server's max_model_len {max_model_len}: give shorter ones"
        )


def _warn_in_flight(config: LoadtestConfig, num_requests: int, err: IO[str]) -> None:
    cap = config.max_concurrency or num_requests
    if config.client.backend == "grpc" and min(cap, num_requests) > IN_FLIGHT_WARNING_THRESHOLD:
        err.write(
            "loadtest: more than 1000 requests may be in flight; a grpc.aio server without a "
            "raised grpc.server.max_pending_requests CANCELs some (counted as CANCELLED). "
            "Consider --max-concurrency.\n"
        )


async def _run(
    config: LoadtestConfig, client_factory: ClientFactory, out: IO[str], err: IO[str]
) -> tuple[list[RunResult], list[RunSummary], str]:
    """Every run of the config; also the model id (flag, else the server's name)."""
    client = client_factory(config.client)
    try:
        info = await _model_info(config, client)
        model_id = config.model_id or (info.model_name if info else "") or config.client.model
        vocab_size = _resolve_vocab_size(config, info, err)
        wl = config.workload
        if info is not None and info.max_model_len > 0:
            _check_lengths(wl, info.max_model_len)  # before drawing the prompts
        requests = build_requests(wl, wl.num_prompts, vocab_size, config.arrivals.seed)
        if not requests:
            raise LoadtestConfigError(f"the {wl.dataset_name} workload produced no requests")
        _warn_in_flight(config, len(requests), err)
        if config.num_warmups > 0:
            warm = build_requests(
                wl, config.num_warmups, vocab_size, config.arrivals.seed + 1, "warmup"
            )
            records = await run_warmups(client, warm, config.max_concurrency)
            num_failed = sum(not r.is_success for r in records)
            err.write(f"loadtest: {len(records)} warm-up requests done, {num_failed} failed\n")
        results, summaries = [], []
        for rate in config.rates:
            spec = dataclasses.replace(config.arrivals, request_rate=rate)
            label = f"rate {rate:g}"
            progress = (
                LiveProgress(len(requests), err, label=label) if config.show_progress else None
            )
            result = await run_once(client, requests, spec, config.max_concurrency, progress)
            summary = summarize(
                result.records,
                result.duration_s,
                result.run_start_s,
                rate,
                config.max_concurrency,
                config.percentiles,
                config.goodput,
            )
            results.append(result)
            summaries.append(summary)
        return results, summaries, model_id
    finally:
        close = getattr(client, "close", None)
        if close is not None:
            await close()


def result_path(config: LoadtestConfig, model_id: str) -> str | None:
    """--result-json, else with --save-result vLLM's file name in --result-dir."""
    if config.result_json or not config.save_result:
        return config.result_json
    if config.result_filename:
        name = config.result_filename
    else:
        rates = config.rates
        rate = "sweep" if len(rates) > 1 else f"{rates[0]:g}"
        cap = f"-concurrency{config.max_concurrency}" if config.max_concurrency else ""
        model = model_id.rstrip("/").rsplit("/", 1)[-1] or "model"
        name = (
            f"{config.client.backend}-{rate}qps{cap}-{model}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        )
    Path(config.result_dir).mkdir(parents=True, exist_ok=True)
    return str(Path(config.result_dir) / name)


def _write_outputs(
    config: LoadtestConfig,
    results: list[RunResult],
    summaries: list[RunSummary],
    model_id: str,
    out: IO[str],
) -> None:
    info = RunInfo(
        target=config.client.url or config.client.target,
        dataset_name=config.workload.dataset_name,
        num_prompts=len(results[0].records),
        request_rate_mode=config.arrivals.mode,
        burstiness=config.arrivals.burstiness,
        seed=config.arrivals.seed,
        num_warmups=config.num_warmups,
        percentile_metrics=config.percentile_metrics,
        label=config.label,
        backend=config.client.backend,
        model_id=model_id,
        tokenizer_id=config.workload.tokenizer_path or model_id,
    )
    for summary in summaries:
        out.write(format_summary_table(summary, info) + "\n")
    out.write(METRIC_FOOTNOTE + "\n")
    if len(summaries) > 1:
        out.write(format_sweep_table(summaries) + "\n")
    if path := result_path(config, model_id):
        objects = [summary_to_json(s, info) for s in summaries]
        write_result_json(path, objects, is_sweep=bool(config.sweep_rates))
    if config.per_request_jsonl:
        with open(config.per_request_jsonl, "w", encoding="utf-8") as f:
            for result in results:
                write_per_request_jsonl(f, result.records, result.run_start_s, result.request_rate)
    if config.plot_path:
        from loadgen.plot import write_plot  # matplotlib was checked before the run

        write_plot(config.plot_path, results, summaries)


def run_loadtest(
    args: argparse.Namespace,
    client_factory: ClientFactory = make_client,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
) -> int:
    """Run the load test the flags describe; returns the process exit status."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        config = config_from_args(args)
        results, summaries, model_id = asyncio.run(_run(config, client_factory, out, err))
        _write_outputs(config, results, summaries, model_id, out)
    except (ValueError, OSError, ImportError) as exc:  # incl. LoadtestConfigError
        err.write(f"loadtest: {exc}\n")
        return 2
    return 0 if any(s.completed for s in summaries) else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m loadgen`."""
    parser = argparse.ArgumentParser(prog="dsv4 loadtest", description=__doc__.splitlines()[0])
    add_loadtest_args(parser)
    return run_loadtest(parser.parse_args(argv))
