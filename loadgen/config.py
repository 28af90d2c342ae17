"""The load test's configuration, parsed once from the command line and frozen, and the
function that turns its workload part into requests."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loadgen.arrivals import ArrivalSpec
from loadgen.client import BACKEND_ALIASES, ClientOptions
from loadgen.datasets import Encode, load_mooncake_trace, load_sharegpt, load_tokenizer
from loadgen.metrics import METRIC_NAMES, GoodputSLO, parse_goodput
from loadgen.target import LoadtestConfigError, resolve_endpoint
from loadgen.workloads import LengthRange, LoadRequest, random_requests, shared_prefix_requests

DATASET_NAMES = ("random", "shared-prefix", "sharegpt", "trace")
ALWAYS_REPORTED_PERCENTILES = (90.0, 99.0)
PLOT_MISSING = "--plot needs matplotlib: pip install 'dsv4-serve[plot]' (or drop --plot)"
__all__ = ["LoadtestConfig", "LoadtestConfigError", "WorkloadSpec", "config_from_args"]


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
    client: ClientOptions
    model_id: str  # --model ("": the server's name for it)
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
    save_result: bool  # vLLM's spelling: write into result_dir / result_filename
    result_dir: str
    result_filename: str | None
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
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise LoadtestConfigError(PLOT_MISSING)  # before the run, not after it
    for flag, path in (("--result-json", args.result_json), ("--plot", args.plot),
                       ("--per-request-jsonl", args.per_request_jsonl)):  # fmt: skip
        _check_output(flag, path)
    if args.save_result and not args.result_json:
        _check_result_dir(args.result_dir, args.result_filename)
    if not (math.isfinite(args.trace_time_scale) and args.trace_time_scale >= 0):
        raise LoadtestConfigError(
            f"--trace-time-scale {args.trace_time_scale}: give a finite number >= 0 "
            "(0.5 replays the trace 2x faster)"
        )
    _check_tls_ca(args.tls_ca)
    backend = BACKEND_ALIASES.get(args.backend, args.backend)
    endpoint = resolve_endpoint(
        backend, args.target, args.host, args.port, args.base_url, args.endpoint,
        use_tls=bool(args.tls_ca),
    )  # fmt: skip
    return LoadtestConfig(
        client=ClientOptions(
            target=endpoint.target,
            backend=backend,
            url=endpoint.url,
            models_url=endpoint.models_url,
            model=args.served_model_name or args.model or "",
            timeout_s=args.timeout_s,
            tls_ca_path=args.tls_ca,
            api_key=args.api_key,
            ignore_eos=args.ignore_eos,
            temperature=args.temperature,
            tokenizer_path=args.tokenizer,
        ),
        model_id=args.model or "",
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
        save_result=args.save_result,
        result_dir=args.result_dir,
        result_filename=args.result_filename,
        per_request_jsonl=args.per_request_jsonl,
        plot_path=args.plot,
        show_progress=not args.no_progress,
        label=args.label,
    )


def _tokenizer_encode(path: str) -> Encode:
    tokenizer = load_tokenizer(path)
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
    try:
        rate = float(text)
    except ValueError:  # argparse would name this function instead of the fix
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number: give requests per second (> 0) or inf"
        ) from None
    if math.isnan(rate) or rate <= 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {text!r}")
    return rate


def _check_output(flag: str, path: str | None) -> None:
    """An output file's folder must exist and be writable before the run, not after it (a
    typo in a path used to cost the whole run, then fail with a bare errno line)."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise LoadtestConfigError(f"{flag} {path}: folder {folder} does not exist")
    if os.path.isdir(path) or not os.access(folder, os.W_OK):
        raise LoadtestConfigError(f"{flag} {path}: cannot write a file there")


def folder_blocker(folder: Path) -> Path | None:
    """Where making or writing the absolute `folder` fails, checked before any work: its
    nearest existing path (itself or an ancestor) when that is not a writable folder; None when
    the folder is, or can be made. `dsv4 up`'s --cache-dir / --log-dir checks use it too."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    return None if existing.is_dir() and os.access(existing, os.W_OK) else existing


def _check_result_dir(result_dir: str, filename: str | None) -> None:
    """--save-result's file goes into --result-dir (created after the run, as vLLM does): that
    it can be created and written there is checked before the run, not after it."""
    folder = Path(result_dir).absolute()
    blocker = folder_blocker(folder)
    if blocker is not None:
        raise LoadtestConfigError(
            f"--result-dir {result_dir}: cannot make or write a folder there "
            f"({blocker} is not a writable folder)"
        )
    if not filename:
        return
    parent = (folder / filename).parent
    if parent != folder and not parent.is_dir():
        raise LoadtestConfigError(
            f"--result-filename {filename}: folder {parent} does not exist "
            "(only --result-dir is made)"
        )
    if folder.is_dir():
        _check_output("--result-filename", str(folder / filename))


def _check_tls_ca(path: str | None) -> None:
    """--tls-ca must be a readable PEM certificate before anything connects (gRPC's C core
    would log four lines and fail the run; ssl an error that names no flag)."""
    if not path:
        return
    fix = "give the PEM file of the CA that signed the server's certificate"
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise LoadtestConfigError(
            f"--tls-ca {path}: cannot read it ({exc.strerror}): {fix}"
        ) from None
    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise LoadtestConfigError(f"--tls-ca {path}: not a PEM certificate: {fix}")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except (ssl.SSLError, ValueError):
        raise LoadtestConfigError(
            f"--tls-ca {path}: a PEM certificate that does not parse: {fix}"
        ) from None
