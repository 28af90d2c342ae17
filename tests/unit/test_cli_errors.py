"""Every user error of every `dsv4` command is one line on stderr that names the flag, with a
non-zero exit status and no traceback: a table of bad invocations, run as a user runs them.

Rows run in-process through `dsv4.commands.cli.main` (each fails before any model loads or service
starts); two run as real processes to show what a terminal gets.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4.commands.cli import DEBUG_ENV, main

REPO = Path(__file__).resolve().parents[2]
MODEL = "{model}"  # a config-only tiny checkpoint (config.json + tokenizer.json)
GEN = ["generate", "--model", MODEL, "--prompt-ids", "1,2"]
ICS = ["indexcache-search", "--model", MODEL]
PLAN = ["plan", "--shape", "pro", "--gpu-mem", "80"]
UP_CARD = ["up", "--model", MODEL, "--device", "cpu", "--device-memory-gib"]

# (argv, what the one line must contain: the flag, or the path the user gave)
BAD = [
    ([], "command"),
    (["--log-level", "loud", "plan"], "--log-level"),
    ([*GEN, "--temperature", "-1"], "--temperature"),
    ([*GEN, "--top-p", "2"], "--top-p"),
    ([*GEN, "--top-k", "-3"], "--top-k"),
    ([*GEN, "--max-new-tokens", "-1"], "--max-new-tokens"),
    ([*GEN, "--stop", ""], "--stop"),
    ([*GEN, "--dtype", "float16"], "--dtype"),
    (["generate", "--model", MODEL, "--prompt-ids", "5000"], "--prompt-ids"),
    (["generate", "--model", MODEL, "--prompt-ids", "1,x"], "--prompt-ids"),
    (["generate", "--model", MODEL, "--prompt", ""], "--prompt"),
    (["generate", "--model", "/nonexistent/ckpt", "--prompt-ids", "1"], "--model"),
    (["generate", "--prompt-ids", "1"], "--model"),
    (["make-tiny", "/proc/nope"], "OUT_DIR"),
    (["make-tiny", "{tmp}/t", "--layers", "0,x"], "--layers"),
    (["make-tiny", "{tmp}/t", "--layers", "0,3"], "--layers"),
    (["make-tiny", "{tmp}/t", "--shape", "huge"], "--shape"),
    (["make-tiny", "{tmp}/t", "--seed", "x"], "--seed"),
    (["train-tiny", "/proc/nope"], "OUT_DIR"),
    (["train-tiny", "{tmp}/t", "--minutes", "0"], "--minutes"),
    (["train-tiny", "{tmp}/t", "--steps", "0"], "--steps"),
    (["train-tiny", "{tmp}/t", "--moe-intermediate-size", "100"], "--moe-intermediate-size"),
    ([*PLAN, "--gpus", "0"], "--gpus"),
    (["plan", "--shape", "pro", "--gpu-mem", "0"], "--gpu-mem"),
    ([*PLAN, "--host-mem", "-1"], "--host-mem"),
    (["plan", "--shape", "pro"], "--gpu-mem"),
    ([*PLAN, "--gpus", "8", "--gpus-per-node", "3"], "--gpus-per-node"),
    ([*PLAN, "--tpot-slo-ms", "0"], "--tpot-slo-ms"),
    ([*PLAN, "--h2d-gbps", "0"], "--h2d-gbps"),
    ([*PLAN, "--h2d-gbps", "nan"], "--h2d-gbps"),
    ([*PLAN, "--tp", "3"], "--tp"),
    (["plan", "--model", "/nonexistent/ckpt", "--gpu-mem", "80"], "--model"),
    ([*PLAN, "--routing-stats", "/nonexistent/stats.json"], "--routing-stats"),
    ([*PLAN, "--residency-out", "{tmp}/r.json"], "--residency-out"),
    ([*ICS, "--budget", "0"], "--budget"),
    ([*ICS, "--budget", "x"], "--budget"),
    ([*ICS, "--budget", "1", "--seq-len", "0"], "--seq-len"),
    ([*ICS, "--budget", "1", "--device", "cuda:7"], "--device"),
    ([*ICS, "--budget", "1", "--calib", "/nonexistent.txt"], "--calib"),
    (["indexcache-search", "--model", "/nonexistent/ckpt", "--budget", "1"], "--model"),
    (["router", "--port", "x"], "--port"),
    (["router", "--port", "99999"], "--port"),
    (["router", "--max-num-seqs", "-1"], "--max-num-seqs"),
    (["router", "--config", "/nonexistent.yaml"], "/nonexistent.yaml"),
    (["router", "--bogus"], "--bogus"),
    (["prefill", "--block-size", "7"], "--block-size"),
    (["prefill", "--role", "colocated"], "--role"),
    (["decode", "--role", "potato"], "--role"),
    (["decode", "--config", "/nonexistent.yaml"], "/nonexistent.yaml"),
    # the router's listening flags: a worker listens on --worker-host / --worker-port (it used
    # to take them and serve elsewhere, silently)
    (["decode", "--port", "5000"], "a worker listens on --worker-port"),
    (["prefill", "--host", "0.0.0.0"], "a worker binds --worker-host"),
    (["decode", "--role", "colocated", "--http-port", "8000"], "--http-port is the router's"),
    (["loadtest", "--request-rate", "abc"], "--request-rate"),
    (["loadtest", "--num-prompts", "x"], "--num-prompts"),
    (["loadtest", "--num-prompts", "-3"], "--num-prompts"),
    (["loadtest", "--random-output-len", "0"], "--random-output-len"),
    (["loadtest", "--timeout-s", "nan"], "--timeout-s"),
    (["loadtest", "--max-concurrency", "0"], "--max-concurrency"),
    (["loadtest", "--dataset-name", "nope"], "--dataset-name"),
    (["up", "--num-prefill", "0"], "--num-prefill"),
    (["up", "--num-decode", "x"], "--num-decode"),
    (["up", "--port", "99999"], "--port"),
    (["up", "--http-port", "-1"], "--http-port"),
    (["up", "--model", "/nonexistent/ckpt"], "--model"),
    (["up", "--layout", "sideways"], "--layout"),
    # a card of 10 MiB holds neither P + D nor one colocated worker (exit 1, as `dsv4 plan`)
    ([*UP_CARD, "0.01"], "--layout auto: neither 2 workers"),
    ([*UP_CARD, "0.01", "--layout", "colocated"], "--layout colocated: does not fit"),
    (["demo", "--request-rate", "abc"], "--request-rate"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from dsv4.model.tiny import tiny_config, write_model_spec

    return str(write_model_spec(tmp_path_factory.mktemp("spec"), tiny_config()))


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse, and `dsv4 router`'s own exit
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("argv", "names"), BAD, ids=[" ".join(a) or "(none)" for a, _ in BAD])
def test_bad_invocation_is_one_line_naming_the_flag(
    argv: list[str], names: str, model_dir: str, tmp_path: Path, monkeypatch, capsys
) -> None:
    for name in [n for n in os.environ if n.startswith("DSV4_")]:
        monkeypatch.delenv(name)  # the config's env layer must not fill in a value
    argv = [a.format(model=model_dir, tmp=tmp_path) for a in argv]
    code, err = run(argv, capsys)
    assert code not in (0, None), err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and names in lines[0], err
    assert lines[0].startswith("dsv4"), err


def test_a_layout_that_does_not_fit_exits_1_as_dsv4_plan_does(model_dir: str, capsys) -> None:
    code, err = run([a.format(model=model_dir) for a in (*UP_CARD, "0.01")], capsys)
    assert code == 1 and err.startswith("dsv4 up: error: --layout auto: neither"), err


def test_a_bug_is_one_line_with_how_to_get_its_traceback(monkeypatch, capsys) -> None:
    """An unexpected exception is a bug: one line that says so; DSV4_DEBUG=1 re-raises it."""
    import dsv4.commands.plan

    def broken(args):
        raise KeyError("no such thing")

    monkeypatch.setattr(dsv4.commands.plan, "run_plan", broken)
    argv = ["plan", "--shape", "flash", "--gpu-mem", "80"]
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    code, err = run(argv, capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "internal error KeyError" in err and f"{DEBUG_ENV}=1" in err
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(KeyError):
        main(argv)


@pytest.mark.parametrize(
    "argv",
    [["generate", "--model", MODEL, "--prompt-ids", "5000"], ["make-tiny", "/proc/nope"]],
    ids=["out-of-vocabulary", "unwritable-dir"],
)
def test_the_terminal_gets_one_line(argv: list[str], model_dir: str) -> None:
    """The two invocations that used to end in 50- and 24-line tracebacks, as processes."""
    argv = [a.format(model=model_dir) for a in argv]
    env = {k: v for k, v in os.environ.items() if k != DEBUG_ENV}
    result = subprocess.run(
        [sys.executable, "-m", "dsv4.commands.cli", *argv],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr


def test_version_and_help_hide_internal_flags(capsys) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"dsv4-serve {version('dsv4-serve')}"
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--parent-pid" not in capsys.readouterr().out  # set by `dsv4 up` on its children
