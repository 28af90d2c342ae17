"""`dsv4 up` and `dsv4 demo`: argument parsing and the two commands over `dsv4.commands.cluster`.

`up` runs a `LocalCluster` until Ctrl-C / SIGTERM (exit 0) or until a service dies (exit 1).
`demo` is `up` + a short `dsv4 loadtest` (16 requests at 4/s, random 32-128 input and 10-38
output tokens) + its printed report + shutdown; exit 0 when every request succeeded.

Both lay the workers out first (`--layout`, `dsv4.commands.layout`): P and D side by side, or one
colocated worker; on one card, or with `--gpus` on cards of their own (`dsv4.commands.placement`).
The plan line says which, where and why (not printed when there is no card to plan and no
layout was asked for: the CPU default). A layout that cannot fit is one line on stderr and exit
1; a `--gpus` that names cards not there is a usage error (exit 2).

Everything that can be checked is checked before any service starts (a failed start takes
seconds, and a worker count nobody meant could fill the host's memory): each flag's range, the
workers the host's memory can hold (`dsv4.commands.layout.check_host_memory`), that the ports
the launcher gives (--port, --http-port, --metrics-base-port and the next ones) are free, and
that no service would refuse a flag `up` passes on. A service that still fails to start is one
line on stderr carrying its own error: exit 2 when that was a user error (the service exited
2), else 1.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import time
from pathlib import Path

from dsv4.commands.cluster import (
    AUTO_PORTS,
    DEFAULT_CACHE_DIR,
    ClusterSpec,
    LocalCluster,
    StartFailed,
)
from dsv4.commands.layout import LAYOUTS, LayoutChoice, plan_layout
from dsv4.commands.placement import parse_gpus
from dsv4.commands.service_args import RaisingParser, unknown_service_flags
from dsv4.commands.tiny_checkpoint import ensure_tiny_checkpoint
from dsv4.errors import Dsv4Error, UsageError
from dsv4.plan import PlanDoesNotFit
from dsv4.serving.ports import bind_problem

MAX_POOL_WORKERS = 64  # a pool of more workers on one host is a typo, not a plan
MAX_RANKS = 64  # rank processes of one worker (a card each on CUDA)
PORT_MAX = 65535


def add_up_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=50051, help="router port")
    parser.add_argument("--host", default="127.0.0.1", help="bind address of every service")
    parser.add_argument("--num-prefill", type=int, default=1, help="prefill workers (N)")
    parser.add_argument("--num-decode", type=int, default=1, help="decode workers (M)")
    parser.add_argument(
        "--layout", choices=LAYOUTS, default="auto",
        help="disaggregated (P and D side by side: sharing one card, each at --memory-fraction "
        "F/(N+M), or on cards of their own with --gpus), colocated (one worker doing both) or "
        "auto (disaggregated when each worker holds the model at its share without offload, "
        "else colocated; the plan line says why)",
    )  # fmt: skip
    parser.add_argument(
        "--gpus", type=parse_gpus, default=None, metavar="N|all|LIST",
        help="CUDA cards for the workers, each worker on whole cards of its own (prefill first; "
        "T ranks: T cards): the first N, all, or indices such as 0,2,3 (default: every worker "
        "on one card, as --device says)",
    )  # fmt: skip
    parser.add_argument("--model", default="tiny", help="checkpoint dir, or tiny (written once)")
    parser.add_argument("--layers", default="", help="--model tiny only: compress ratios, e.g. 0,4")
    parser.add_argument("--redis", default="", help="Redis registry URL (default: static lists)")
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE_DIR), help="tiny checkpoint dir")
    parser.add_argument("--log-dir", default="", help="service logs (default: a temp dir)")
    parser.add_argument(
        "--ready-timeout-s", type=float, default=180.0, help="wait for every service's SERVING"
    )
    parser.add_argument("--grace-s", type=float, default=10.0, help="SIGTERM -> SIGKILL delay")
    parser.add_argument(
        "--metrics-base-port", type=int, default=None,
        help="Prometheus /metrics: router on this port, workers on the next ones "
        "(default: a free port each, printed; 0: off)",
    )  # fmt: skip
    parser.add_argument(
        "--http-port", type=int, default=0, help="router's OpenAI-compatible HTTP port (0: off)"
    )
    for role in ("prefill", "decode"):
        parser.add_argument(
            f"--{role}-ranks", type=int, default=0,
            help=f"rank processes per {role} worker (its --tensor-parallel-size; 0: as the "
            "other flags say)",
        )  # fmt: skip
    parser.set_defaults(handler=cmd_up, accepts_extra_args=True)


def add_demo_args(parser: argparse.ArgumentParser) -> None:
    add_up_args(parser)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--request-rate", default="4", type=_rate_text, help="req/s or inf")
    parser.set_defaults(handler=cmd_demo)


def _rate_text(text: str) -> str:
    """--request-rate checked now (as `dsv4 loadtest` checks it), passed on as typed."""
    from loadgen.config import rate_from_text

    try:
        rate_from_text(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give req/s (> 0) or inf, not {text!r}") from None
    return text


def _check_up_args(args: argparse.Namespace) -> None:
    """What can be checked before any service starts (a failed start takes seconds)."""
    for flag, count in (("--num-prefill", args.num_prefill), ("--num-decode", args.num_decode)):
        if not 1 <= count <= MAX_POOL_WORKERS:
            raise UsageError(f"{flag} {count}: give 1..{MAX_POOL_WORKERS} workers (each a "
                             "process of its own holding the model)")  # fmt: skip
    for flag, ranks in (("--prefill-ranks", args.prefill_ranks),
                        ("--decode-ranks", args.decode_ranks)):  # fmt: skip
        if not 0 <= ranks <= MAX_RANKS:
            raise UsageError(f"{flag} {ranks}: give 1..{MAX_RANKS} ranks (0: as the flags say)")
    if not 0 < args.port <= PORT_MAX:
        raise UsageError(f"--port {args.port}: give a TCP port in 1..65535")
    if not 0 <= args.http_port <= PORT_MAX:
        raise UsageError(f"--http-port {args.http_port}: give a TCP port in 1..65535 (0: off)")
    if args.http_port == args.port:
        raise UsageError(f"--http-port {args.http_port}: --port has it; give another port")
    base = args.metrics_base_port
    if base is not None and not 0 <= base <= PORT_MAX:
        raise UsageError(f"--metrics-base-port {base}: give a TCP port in 1..65535 (0: off; "
                         "left out: a free port each)")  # fmt: skip
    for flag, seconds in (("--ready-timeout-s", args.ready_timeout_s),
                          ("--grace-s", args.grace_s)):  # fmt: skip
        if not (math.isfinite(seconds) and seconds > 0):
            raise UsageError(f"{flag} {seconds:g}: give a positive number of seconds")
    model_dir = Path(args.model.removeprefix("random:"))
    if args.model != "tiny" and not (model_dir / "config.json").is_file():
        raise UsageError(
            f"--model {args.model}: no config.json there; give a checkpoint dir, random:DIR "
            "(dsv4 make-tiny DIR --config-only) or tiny"
        )
    for flag, folder in (("--cache-dir", args.cache_dir if args.model == "tiny" else None),
                         ("--log-dir", args.log_dir or None)):  # fmt: skip
        if folder is not None:
            _check_folder(flag, folder)
    if args.layers and args.model != "tiny":
        raise UsageError(f"--layers {args.layers}: only for --model tiny (a checkpoint has its "
                         "own layers; dsv4 make-tiny DIR --layers writes one)")  # fmt: skip
    unknown = unknown_service_flags(tuple(getattr(args, "extra_args", ())))
    if unknown:
        raise UsageError(f"unrecognized arguments: {' '.join(unknown)} (dsv4 {args.command} "
                         "passes flags it does not know to every service; see dsv4 decode -h)")  # fmt: skip


def _check_folder(flag: str, folder: str) -> None:
    """A folder `up` makes and writes (the tiny checkpoint's, the logs'): one that cannot be
    was a bare errno line with no flag; an empty one wrote into the current directory."""
    if not folder.strip():
        raise UsageError(f"{flag} '': give a folder (. for the current one)")
    from loadgen.config import folder_blocker

    blocker = folder_blocker(Path(folder).absolute())
    if blocker is not None:
        raise UsageError(f"{flag} {folder}: cannot make or write a folder there ({blocker} is "
                         "not a writable folder)")  # fmt: skip


def check_ports(spec: ClusterSpec) -> None:
    """The ports the launcher gives its services are in range and free now (a bind test):
    `UsageError` naming the flag otherwise."""
    problem = bind_problem(spec.host, 0)
    if problem:
        raise UsageError(f"--host {spec.host}: {problem}")
    ports = [("--port", spec.router_port)]
    ports += [("--http-port", spec.http_port)] if spec.http_port else []
    base = spec.metrics_base_port
    if base > 0:
        workers = spec.num_prefill + spec.num_decode
        if base + workers > PORT_MAX:
            raise UsageError(f"--metrics-base-port {base}: the router's /metrics takes it and "
                             f"the {workers} workers' the next ports, past {PORT_MAX}; give at "
                             f"most {PORT_MAX - workers}")  # fmt: skip
        taken = {port: flag for flag, port in ports if base <= port <= base + workers}
        if taken:
            port, flag = next(iter(taken.items()))
            raise UsageError(f"--metrics-base-port {base}: the services' /metrics take "
                             f"{base}..{base + workers}, {flag} has {port}; give another")  # fmt: skip
        ports += [("--metrics-base-port", base + i) for i in range(workers + 1)]
    for flag, port in ports:
        problem = bind_problem(spec.host, port)
        if problem:
            given = port if flag != "--metrics-base-port" else base
            raise UsageError(f"{flag} {given}: {problem} (another server, or another dsv4 "
                             "up?); give a free port")  # fmt: skip


def cluster_from_args(args: argparse.Namespace) -> tuple[ClusterSpec, LayoutChoice]:
    """The cluster to start, laid out on its cards (`dsv4.commands.layout`); raises
    `PlanDoesNotFit` for a layout that cannot fit."""
    return plan_layout(_spec_from_args(args), args.layout, args.gpus)


def _spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    _check_up_args(args)
    model = args.model
    if model == "tiny":
        model = str(ensure_tiny_checkpoint(Path(args.cache_dir), args.layers))
    base = AUTO_PORTS if args.metrics_base_port is None else args.metrics_base_port
    return ClusterSpec(
        model_dir=model, host=args.host, router_port=args.port, num_prefill=args.num_prefill,
        num_decode=args.num_decode, redis_url=args.redis, log_dir=args.log_dir,
        service_args=tuple(getattr(args, "extra_args", ())), grace_s=args.grace_s,
        metrics_base_port=base, http_port=args.http_port, ready_timeout_s=args.ready_timeout_s,
        prefill_args=_ranks_args(args.prefill_ranks), decode_args=_ranks_args(args.decode_ranks),
    )  # fmt: skip


def _ranks_args(ranks: int) -> tuple[str, ...]:
    return ("--tensor-parallel-size", str(ranks)) if ranks else ()


def cmd_up(args: argparse.Namespace) -> int:
    """Run until Ctrl-C / SIGTERM (exit 0) or until a service dies (exit 1)."""
    spec = _laid_out(args)
    if spec is None:
        return 1
    _say_redis_wait(args)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        with LocalCluster(spec) as cluster:
            http = f"; OpenAI-compatible HTTP {cluster.http_url}" if cluster.http_url else ""
            _say(f"dsv4 cluster up: router {cluster.router_address}{http}; prefill "
                 f"{cluster.addresses('prefill')}; decode {cluster.addresses('decode')}; "
                 f"{_metrics_and_logs(cluster)}; Ctrl-C stops")  # fmt: skip
            if cluster.secret_path:
                _say(f"worker RPCs need the generated shared secret in {cluster.secret_path} "
                     "(DSV4_SHARED_SECRET=$(cat FILE) for deploy/scripts/drain.py)")  # fmt: skip
            while not (dead := cluster.dead_services()):
                time.sleep(0.5)
            _say(f"{dead[0].name} exited ({dead[0].process.returncode}):\n{dead[0].log_tail()}")
            return 1
    except KeyboardInterrupt:
        _say("dsv4 cluster stopped")
        return 0
    except StartFailed as exc:
        return _start_failed(args, exc)
    except Dsv4Error as exc:
        _error(args, exc.message)
        return 1


def cmd_demo(args: argparse.Namespace) -> int:
    """up + `dsv4 loadtest` (random 32-128 input, 10-38 output tokens) + report + shutdown."""
    if args.num_prompts < 1:
        raise UsageError(f"--num-prompts {args.num_prompts}: give at least 1 request")
    _load_args("127.0.0.1:1", args, Path("summary.json"))  # the load test's flags, checked now
    spec = _laid_out(args)
    if spec is None:
        return 1
    _say_redis_wait(args)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        with LocalCluster(spec) as cluster:
            _say(f"dsv4 demo: cluster up (router {cluster.router_address}); running the load test")
            status = _run_demo_load(cluster.router_address, args)
            if cluster.dead_services():
                _say(f"dsv4 demo: {cluster.dead_services()[0].name} died during the run")
                return 1
            return status
    except KeyboardInterrupt:
        return 130
    except StartFailed as exc:
        return _start_failed(args, exc)
    except Dsv4Error as exc:
        _error(args, exc.message)
        return 1


def _laid_out(args: argparse.Namespace) -> ClusterSpec | None:
    """The spec, after the plan line (printed unless nothing was planned or asked), its ports
    checked; None after a one-line refusal on stderr (exit 1: the layout cannot fit, as
    `dsv4 plan` exits)."""
    try:
        spec, choice = cluster_from_args(args)
    except PlanDoesNotFit as exc:
        _error(args, exc.message)
        return None
    check_ports(spec)
    if choice.memory_fraction or args.layout != "auto" or args.gpus is not None:
        _say(choice.line)
    return spec


def _start_failed(args: argparse.Namespace, exc: StartFailed) -> int:
    """One line on stderr for a service that did not start, with its own error line: exit 2
    when that was a user error (the service exited 2) or another server holds --port."""
    ranks = getattr(args, f"{exc.role}_ranks", 0)
    shaped = f" (--{exc.role}-ranks {ranks})" if ranks else ""
    text = f"{exc.service_name}{shaped} {exc.what}"
    if exc.reason:
        text += f": {exc.reason}"
    if exc.foreign:
        text += "; give a free --port" if exc.role == "router" else "; run it again"
    elif exc.exit_code is None:  # not SERVING in time
        waiting = _redis_problem(args.redis) if args.redis else ""
        text += f" (--ready-timeout-s {args.ready_timeout_s:g}: a longer one waits more)"
        text += f"; Redis at {args.redis} (--redis): {waiting}" if waiting else ""
    if args.log_dir:
        text += f"; logs in {args.log_dir}"
    elif exc.exit_code != 2:
        text += "; --log-dir DIR keeps the services' logs"
    _error(args, text)
    return 2 if exc.exit_code == 2 or (exc.foreign and exc.role == "router") else 1


def _say_redis_wait(args: argparse.Namespace) -> None:
    """The services wait for an unreachable Redis (up to --ready-timeout-s): say so once."""
    problem = _redis_problem(args.redis) if args.redis else ""
    if problem:
        sys.stderr.write(f"dsv4 {args.command}: waiting for Redis at {args.redis} (--redis): "
                         f"{problem}; the services retry for up to --ready-timeout-s "
                         f"{args.ready_timeout_s:g} s\n")  # fmt: skip
        sys.stderr.flush()


def _redis_problem(url: str) -> str:
    """Why Redis at `url` does not answer a PING now (within about a second); "" when it does."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=1.0,
                                      retry=Retry(NoBackoff(), 0))  # fmt: skip
        with client:
            client.ping()
    except (redis.RedisError, ValueError, OSError) as exc:
        return " ".join(str(exc).split()).rstrip(".") or type(exc).__name__
    return ""


def _metrics_and_logs(cluster: LocalCluster) -> str:
    urls = " ".join(f"{name}={url}" for name, url in cluster.metrics_urls().items())
    return f"metrics {urls or 'off'}; logs {cluster.log_dir}"


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _error(args: argparse.Namespace, text: str) -> None:
    sys.stderr.write(f"dsv4 {args.command}: error: {' '.join(text.split())}\n")
    sys.stderr.flush()


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _load_args(target: str, args: argparse.Namespace, summary_path: Path) -> argparse.Namespace:
    """`dsv4 loadtest`'s flags for the demo's load; `UsageError` for one it refuses."""
    from loadgen.cli import add_loadtest_args

    parser = RaisingParser(prog=f"dsv4 {args.command}")
    add_loadtest_args(parser)
    return parser.parse_args([
        "--target", target, "--num-prompts", str(args.num_prompts),
        "--random-input-len", "80", "--random-output-len", "24",
        "--random-range-ratio", "0.6", "--request-rate", args.request_rate,
        "--timeout-s", "120", "--no-progress", "--result-json", str(summary_path),
    ])  # fmt: skip


def _run_demo_load(target: str, args: argparse.Namespace) -> int:
    """The load test with its report on stdout; 0 only when every request succeeded."""
    import json
    import tempfile

    from loadgen.cli import run_loadtest

    with tempfile.TemporaryDirectory(prefix="dsv4-demo-") as tmp:
        summary_path = Path(tmp) / "summary.json"
        status = run_loadtest(_load_args(target, args, summary_path))
        if status != 0 or not summary_path.exists():
            return status or 1
        summary = json.loads(summary_path.read_text())
    summary = summary[0] if isinstance(summary, list) else summary
    if summary.get("failed", 1):
        _say(f"dsv4 demo: {summary.get('failed')} of {args.num_prompts} requests failed")
        return 1
    return 0
