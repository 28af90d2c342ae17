"""`dsv4` console script: one subcommand per job; each parses its configuration once.

Heavy imports (torch, grpc) happen inside the subcommand that needs them, so `dsv4 --help` and the
router stay light. Every user error ends as one line on stderr that names the flag and the fix
(`main` is the one place that turns errors into that line); set DSV4_DEBUG=1 for tracebacks.
"""

from __future__ import annotations

import argparse
import errno
import io
import json
import logging
import os
import sys
from collections.abc import Callable

Handler = Callable[[argparse.Namespace], int]
DEBUG_ENV = "DSV4_DEBUG"
# The top-level modules of pyproject's optional extras and the extra that installs each: on the
# base (router) install, a command that needs one is a user error naming the extra, not a bug.
EXTRA_OF_MODULE = {
    "torch": "worker",
    "triton": "worker",
    "safetensors": "worker",
    "nixl": "worker",
    "nixl_cu12": "worker",
    "nixl_cu13": "worker",
    "flashinfer": "gpu",
    "matplotlib": "plot",
}


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (the full usage is one `-h` away)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from dsv4.errors import ConfigError, UsageError
    from dsv4.model.tiny import shape_config, write_checkpoint

    cfg = shape_config(args.shape, args.linear_dtype, args.expert_dtype)
    if args.layers:
        from dsv4.commands.generate import parse_ints

        ratios = parse_ints("--layers", args.layers, "compress ratios such as 0,4,128,4")
        if not ratios:  # ",,," used to write a model of no layers
            raise UsageError(f"--layers {args.layers!r}: give compress ratios such as 0,4,128,4")
        try:
            cfg = cfg.with_overrides(num_hidden_layers=len(ratios), compress_ratios=ratios)
        except ConfigError as exc:
            raise UsageError(f"--layers {args.layers}: {exc.fix}") from exc
    if args.config_only:
        from dsv4.model.tiny import write_model_spec

        out = write_model_spec(args.out_dir, cfg)
        print(f"wrote {args.shape} config + tokenizer to {out}: serve it as --model random:{out}")
        return 0
    out = write_checkpoint(args.out_dir, cfg, seed=args.seed, progress=True)
    print(f"wrote {args.shape} checkpoint to {out}")
    return 0


def _cmd_train_tiny(args: argparse.Namespace) -> int:
    from dsv4.commands.train_tiny import train_tiny
    from dsv4.errors import UsageError

    if not args.minutes > 0:
        raise UsageError(f"--minutes {args.minutes}: give a positive wall-time budget, e.g. 3")
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps {args.steps}: give at least 1 (or leave it out: train by time)")

    report = train_tiny(args.out_dir, minutes=args.minutes, seed=args.seed, steps=args.steps,
                        moe_intermediate_size=args.moe_intermediate_size)  # fmt: skip
    print(json.dumps(report.summary()))
    return 0


def _add_make_tiny(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny", help="write a deterministic random checkpoint")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", choices=["tiny", "flash"], default="tiny")
    p.add_argument("--linear-dtype", choices=["fp8", "bf16"], default="fp8")
    p.add_argument("--expert-dtype", choices=["fp4", "fp8", "bf16"], default="fp4")
    p.add_argument("--layers", default="", help="comma-separated compress ratios, e.g. 0,4,128,4")
    p.add_argument(
        "--config-only",
        action="store_true",
        help="config.json + tokenizer.json only (serve with --model random:DIR)",
    )
    p.set_defaults(handler=_cmd_make_tiny)


def _add_train_tiny(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-tiny", help="train the tiny model + MTP layer on stdlib source")
    p.add_argument("out_dir")
    p.add_argument("--minutes", type=float, default=3.0, help="wall-time budget")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="stop after N steps (default: time)")
    p.add_argument("--moe-intermediate-size", type=int, default=None,
                   help="the experts' I (default the tiny 64; 128 takes features.mxfp4_layout "
                   "halves128, so W4A8 experts apply)")  # fmt: skip
    p.set_defaults(handler=_cmd_train_tiny)


# (config field, the line for a worker given it)
_ROUTER_LISTEN_FLAGS = (
    ("router.port", "--port is the router's port; a worker listens on --worker-port"),
    ("router.host", "--host is the router's address; a worker binds --worker-host"),
    ("router.http_port", "--http-port is the router's HTTP front; give it to dsv4 router or up"),
)


def _cmd_worker(role: str) -> Handler:
    def run(args: argparse.Namespace) -> int:
        import os

        from dsv4.commands.worker import run_worker
        from dsv4.config import config_from_args
        from dsv4.errors import UsageError
        from dsv4.serving.logs import configure_logging

        # the router's listening flags are in every service's config, but a worker listens on
        # --worker-host / --worker-port: `dsv4 decode --port N` served on another port, silently
        for dest, line in _ROUTER_LISTEN_FLAGS:
            if getattr(args, dest, None) is not None:
                raise UsageError(line)
        chosen = getattr(args, "worker.role", None)
        allowed = (role, "colocated") if role == "decode" else (role,)
        if chosen is not None and chosen not in allowed:
            raise UsageError(f"--role {chosen}: dsv4 {role} takes --role {' or '.join(allowed)}")
        forced = {} if chosen == "colocated" else {"worker.role": role}
        config = config_from_args(args, os.environ, forced=forced)
        m = config.metrics
        configure_logging(m.log_level, m.log_format, config.worker.worker_id or role)
        return run_worker(config)

    return run


def _cmd_router(args: argparse.Namespace) -> int:
    from router_svc.server import main as router_main

    # The sub-parser has checked the flags (one-line errors); the router parses them again.
    return int(router_main(args.argv[args.argv.index("router") + 1 :]))


def _cmd_loadtest(args: argparse.Namespace) -> int:
    from loadgen.cli import run_loadtest

    return run_loadtest(args)


def _add_services(sub: argparse._SubParsersAction) -> None:
    from dsv4.config import add_config_args

    for role, text in (
        ("prefill", "serve a prefill worker (dsv4.v1.PrefillWorker)"),
        ("decode", "serve a decode worker (dsv4.v1.DecodeWorker; --role colocated: no P needed)"),
    ):
        p = sub.add_parser(role, help=text)
        add_config_args(p)
        p.set_defaults(handler=_cmd_worker(role))
    p = sub.add_parser("router", help="serve the router (dsv4.v1.Router)")
    add_config_args(p)
    p.set_defaults(handler=_cmd_router)
    from loadgen.cli import add_loadtest_args

    p = sub.add_parser("loadtest", help="load-test a router (vLLM metric names, SLO goodput)")
    add_loadtest_args(p)
    p.set_defaults(handler=_cmd_loadtest)
    from dsv4.commands.up import add_demo_args, add_up_args

    add_up_args(sub.add_parser("up", help="start a local cluster: router + prefill + decode"))
    add_demo_args(sub.add_parser("demo", help="up + a short load test + report + shutdown"))


def _die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when its launcher (`dsv4 up`, a test) dies, even by SIGKILL.

    Set here, after exec, rather than in a `preexec_fn`: Python code between fork and exec
    runs grpc's after-fork hooks in the child, whose poller threads then abort when
    subprocess closes the inherited fds ("epoll_wait error: Bad file descriptor")."""
    import ctypes
    import os
    import signal

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        raise SystemExit(f"dsv4: launcher {parent_pid} is gone; not starting")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"dsv4-serve {version('dsv4-serve')}"
    except PackageNotFoundError:
        return "dsv4-serve (not installed: running from a source tree)"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="dsv4", description=__doc__)
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        default="WARNING",
    )
    # Internal: set by `dsv4 up` and tests on the processes they launch (SIGTERM with them).
    parser.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_tiny(sub)
    _add_train_tiny(sub)
    from dsv4.commands.generate import add_generate_parser

    add_generate_parser(sub)
    from dsv4.commands.plan import add_plan_parser

    add_plan_parser(sub)
    from dsv4.commands import indexcache_search

    search = sub.add_parser("indexcache-search", help="find an IndexCache pattern (greedy)")
    indexcache_search.add_arguments(search)
    search.set_defaults(handler=indexcache_search.run)
    _add_services(sub)
    return parser


class _ClosedStdout(io.TextIOBase):
    """sys.stdout where the launcher closed fd 1 (`dsv4 plan >&-`): a write is an OSError that
    `main` reports as one line, as `cat` does, instead of output silently lost (Python sets
    sys.stdout to None there, and `print` drops what it is given)."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "stdout is closed: give it a file, a pipe or >/dev/null")

    def fileno(self) -> int:
        return 1


def _reopen_closed_std_fds() -> None:
    """/dev/null on each of fds 0-2 the launcher left closed (`<&-`, `>&-`, `2>&-`): else the
    next file or socket this process opens takes that number, and whatever writes to "stdout"
    or "stderr" (a C library, a child process) writes into it. With sys.stderr None, an error
    line would go to stdout (`print(file=None)` is stdout); with stdout closed, see above."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: this fd, or dup it
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            if fd == 0:
                sys.stdin = open(fd, closefd=False)  # noqa: SIM115 (the process's stdin)
            elif fd == 1:
                sys.stdout = _ClosedStdout()
            else:
                sys.stderr = open(fd, "w", closefd=False)  # noqa: SIM115 (the process's stderr)


def main(argv: list[str] | None = None) -> int:
    _reopen_closed_std_fds()
    try:
        return _run(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # Ctrl-C: also while the parser imports the commands' modules
        return 130


def _run(argv: list[str]) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra_args", False):
        prog = f"dsv4 {args.command}"
        parser.exit(
            2, f"{prog}: error: unrecognized arguments: {' '.join(extra)} (see {prog} -h)\n"
        )
    args.extra_args, args.argv = extra, argv
    if args.parent_pid:
        _die_with_parent(args.parent_pid)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        code = int(args.handler(args))
        sys.stdout.flush()  # a closed pipe fails here, not in the interpreter's exit flush
        return code
    except Exception as exc:
        if isinstance(exc, BrokenPipeError) and sys.__stdout__ is not None:
            # `dsv4 plan | head`: the reader has what it wanted, so stop quietly, as `cat` does.
            # Only when stdout is that pipe (POLLERR: no reader left), not a peer's socket.
            import select

            fd, poll = sys.__stdout__.fileno(), select.poll()
            poll.register(fd, select.POLLOUT)
            if any(event & select.POLLERR for _, event in poll.poll(0)):
                # stdout onto /dev/null: the exit's flush of what is left would fail again
                os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
                return 0
        if os.environ.get(DEBUG_ENV):
            raise
        missing = _missing_extra(exc)
        if missing is not None:
            print(f"dsv4 {args.command}: error: {missing}", file=sys.stderr)
            return 2
        print(f"dsv4 {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 1 if _is_bug(exc) else getattr(exc, "exit_code", 2)


def _missing_extra(exc: BaseException) -> str | None:
    """The line for a command that needs a module of an extra this install left out (the base
    set has no torch); None for anything else, e.g. a module of an installed package missing."""
    import importlib.util

    name = exc.name if isinstance(exc, ModuleNotFoundError) else None
    top = (name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    try:
        if importlib.util.find_spec(top) is not None:
            return None  # installed: a submodule is missing, a bug
    except ImportError:
        pass  # a finder that refuses the name: not installed, as far as this process goes
    return (
        f"this command needs {top}, which is not installed (the base install is the router's): "
        f"pip install 'dsv4-serve[{extra}]'"
    )


def _is_bug(exc: BaseException) -> bool:
    from dsv4.errors import Dsv4Error

    return not isinstance(exc, Dsv4Error | OSError)


def _one_line(exc: BaseException) -> str:
    """The user's line: typed errors and OS errors (a path the user gave) as they are; anything
    else is a bug, named with how to get its traceback."""
    from dsv4.errors import Dsv4Error

    text = exc.message if isinstance(exc, Dsv4Error) else str(exc)
    if _is_bug(exc):
        text = (
            f"internal error {type(exc).__name__}: {text} "
            f"(a bug: rerun with {DEBUG_ENV}=1 for the traceback and report it)"
        )
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
