"""The load test's configuration, parsed once from the command line and frozen, and the
function that turns its workload part into requests."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from loadgen.arrivals import ArrivalSpec
from loadgen.datasets import Encode, load_mooncake_trace, load_sharegpt
from loadgen.grpc_client import GrpcClientOptions
from loadgen.metrics import METRIC_NAMES, GoodputSLO, parse_goodput
from loadgen.workloads import LengthRange, LoadRequest, random_requests, shared_prefix_requests

DATASET_NAMES = ("random", "shared-prefix", "sharegpt", "trace")
ALWAYS_REPORTED_PERCENTILES = (90.0, 99.0)


class LoadtestConfigError(ValueError):
    """A flag value is wrong; the message names the flag, the value and the fix."""


@dataclass(frozen=True)
class WorkloadSpec:
    dataset_name: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 1000
    input_len: LengthRange = field(default_factory=lambda: LengthRange(1024))
    output_len: LengthRange = field(default_factory=lambda: LengthRange(128))
    prefix_len: int = 512
    prefix_num_groups: int = 4
    sharegpt_output_len: int | None = None
    tokenizer_path: str | None = None
    trace_block_size: int = 512
    trace_time_scale: float = 1.0


@dataclass(frozen=True)
class LoadtestConfig:
    client: GrpcClientOptions
    workload: WorkloadSpec
    arrivals: ArrivalSpec
    sweep_rates: tuple[float, ...]  # empty: one run at arrivals.request_rate
    max_concurrency: int | None
    num_warmups: int
    vocab_size: int | None  # None: ask the server, else DEFAULT_VOCAB_SIZE
    percentiles: tuple[float, ...]
    percentile_metrics: tuple[str, ...]
    goodput: GoodputSLO
    result_json: str | None
    per_request_jsonl: str | None
    plot_path: str | None
    show_progress: bool
    label: str

    @property
    def rates(self) -> tuple[float, ...]:
        return self.sweep_rates or (self.arrivals.request_rate,)


def _floats(flag: str, text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise LoadtestConfigError(f"{flag} {text!r}: expected comma-separated numbers") from None
    if not values:
        raise LoadtestConfigError(f"{flag} {text!r}: expected at least one number")
    return values


def config_from_args(args: argparse.Namespace) -> LoadtestConfig:
    """Validate and freeze the parsed flags. Raises LoadtestConfigError."""
    if args.dataset_name in ("sharegpt", "trace") and not args.dataset_path:
        raise LoadtestConfigError(f"--dataset-name {args.dataset_name} needs --dataset-path FILE")
    metrics = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    if bad := [m for m in metrics if m not in METRIC_NAMES]:
        raise LoadtestConfigError(
            f"--percentile-metrics: unknown {bad}; choose from {METRIC_NAMES}"
        )
    percentiles = _floats("--metric-percentiles", args.metric_percentiles)
    if any(not 0 <= p <= 100 for p in percentiles):
        raise LoadtestConfigError(f"--metric-percentiles {percentiles}: each must be in [0, 100]")
    sweep = _floats("--sweep-rates", args.sweep_rates) if args.sweep_rates else ()
    try:
        arrivals = ArrivalSpec(
            request_rate=args.request_rate,
            mode=args.request_rate_mode,
            burstiness=args.burstiness,
            seed=args.seed,
            use_trace_timestamps=args.trace_timestamps and not sweep,
        )
        for rate in sweep:
            ArrivalSpec(request_rate=rate)
        workload = WorkloadSpec(
            dataset_name=args.dataset_name,
            dataset_path=args.dataset_path,
            num_prompts=args.num_prompts,
            input_len=LengthRange(args.random_input_len, args.random_range_ratio),
            output_len=LengthRange(args.random_output_len, args.random_range_ratio),
            prefix_len=args.prefix_len,
            prefix_num_groups=args.prefix_num_groups,
            sharegpt_output_len=args.sharegpt_output_len,
            tokenizer_path=args.tokenizer,
            trace_block_size=args.trace_block_size,
            trace_time_scale=args.trace_time_scale,
        )
        goodput = parse_goodput(args.goodput or [])
    except ValueError as exc:
        raise LoadtestConfigError(str(exc)) from None
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise LoadtestConfigError(f"--max-concurrency {args.max_concurrency}: must be >= 1")
    return LoadtestConfig(
        client=GrpcClientOptions(
            target=args.target,
            timeout_s=args.timeout_s,
            tls_ca_path=args.tls_ca,
            api_key=args.api_key,
            ignore_eos=args.ignore_eos,
            temperature=args.temperature,
        ),
        workload=workload,
        arrivals=arrivals,
        sweep_rates=sweep,
        max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups,
        vocab_size=args.vocab_size,
        percentiles=tuple(sorted(set(percentiles) | set(ALWAYS_REPORTED_PERCENTILES))),
        percentile_metrics=metrics,
        goodput=goodput,
        result_json=args.result_json,
        per_request_jsonl=args.per_request_jsonl,
        plot_path=args.plot,
        show_progress=not args.no_progress,
        label=args.label,
    )


def _tokenizer_encode(path: str) -> Encode:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(path)
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


def build_requests(
    spec: WorkloadSpec, num: int, vocab_size: int, seed: int, id_prefix: str = "req"
) -> list[LoadRequest]:
    """`num` requests of the configured workload (fewer when a file runs out)."""
    name = spec.dataset_name
    if name == "random":
        return random_requests(num, spec.input_len, spec.output_len, vocab_size, seed, id_prefix)
    if name == "shared-prefix":
        return shared_prefix_requests(
            num,
            spec.prefix_len,
            spec.prefix_num_groups,
            spec.input_len,
            spec.output_len,
            vocab_size,
            seed,
            id_prefix,
        )
    assert spec.dataset_path is not None  # config_from_args checked it
    if name == "sharegpt":
        encode: Callable | None = (
            _tokenizer_encode(spec.tokenizer_path) if spec.tokenizer_path else None
        )
        return load_sharegpt(
            spec.dataset_path, num, seed, spec.sharegpt_output_len, encode, id_prefix
        )
    if name == "trace":
        return load_mooncake_trace(
            spec.dataset_path,
            num,
            vocab_size,
            seed,
            spec.trace_block_size,
            spec.trace_time_scale,
            id_prefix,
        )
    raise LoadtestConfigError(f"--dataset-name {name!r}: choose from {DATASET_NAMES}")


def rate_from_text(text: str) -> float:
    """argparse type for --request-rate: a positive number or `inf`."""
    rate = float(text)
    if math.isnan(rate) or rate <= 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {text!r}")
    return rate
