"""Bad input an outside audit of every `dsv4` subcommand found, run as a user runs it (a real
process): a closed stdout or stderr, config.json sizes of 0, < 0 or past 2**31, an empty
--model, `--layers ,,,`, a CUDA device on a host without one, folders `up` cannot write,
--out a directory, malformed loadtest datasets, a prompt length past the server's context,
--save-result into a file. Each is one line on stderr, exit status 2, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from aiohttp import web

from dsv4.commands import cli
from dsv4.commands.cli import DEBUG_ENV
from tests.unit.test_loadgen_bad_input import serve_in_thread

REPO = Path(__file__).resolve().parents[2]
SECRET = {"DSV4_SHARED_SECRET": "s" * 32}  # a worker refuses to start without one


def dsv4(*argv: str, redirect: str = "", cwd: Path = REPO, env: dict | None = None):
    """`dsv4 ARGV` as a process; `redirect` is a shell redirection such as `>&-`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_") and k != DEBUG_ENV}
    command = [sys.executable, "-m", "dsv4.commands.cli", *argv]
    if redirect:
        command = ["bash", "-c", f'exec "$@" {redirect}', "bash", *command]
    return subprocess.run(command, cwd=cwd, env={**base, **(env or {})}, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def assert_one_line(done: subprocess.CompletedProcess, names: str, code: int = 2) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code and len(lines) == 1, done.stderr
    assert names in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert "internal error" not in done.stderr, done.stderr


# ---- closed standard streams -----------------------------------------------------------------
@pytest.mark.parametrize(
    "argv",
    [["plan", "--shape", "flash", "--gpu-mem", "80"], ["make-tiny", "{tmp}/t", "--config-only"]],
    ids=["plan", "make-tiny"],
)
def test_a_closed_stdout_is_one_line_not_a_bug(argv: list[str], tmp_path: Path) -> None:
    """It was "internal error AttributeError: 'NoneType' object has no attribute 'flush'"."""
    done = dsv4(*[a.format(tmp=tmp_path) for a in argv], redirect=">&-")
    assert_one_line(done, "stdout is closed")


def test_a_closed_stderr_keeps_the_error_off_stdout() -> None:
    """With sys.stderr None, `print(file=sys.stderr)` wrote the error line into stdout."""
    done = dsv4("plan", "--shape", "flash", "--gpu-mem", "0", "--json", redirect="2>&-")
    assert (done.returncode, done.stdout) == (2, "")


def test_ctrl_c_while_the_parser_imports_is_exit_130(monkeypatch) -> None:
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["plan"]) == 130


# ---- model configs and --model ------------------------------------------------------------
@pytest.fixture(scope="module")
def spec_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dsv4.model.tiny import tiny_config, write_model_spec

    return write_model_spec(tmp_path_factory.mktemp("spec"), tiny_config())


def _spec_with(spec_dir: Path, out: Path, **changes) -> Path:
    config = json.loads((spec_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_hidden_layers": 0, "compress_ratios": [0]}, "num_hidden_layers"),  # ValueError
        ({"hidden_size": -8}, "hidden_size"),  # a plan of negative bytes, exit 0
        ({"hidden_size": 10**14}, "hidden_size"),
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"max_position_embeddings": -1}, "max_position_embeddings"),  # named --max-model-len
    ],
)
def test_config_json_sizes_out_of_range_name_the_field(spec_dir, tmp_path, changes, field):
    model = _spec_with(spec_dir, tmp_path, **changes)
    done = dsv4("plan", "--model", f"random:{model}", "--gpu-mem", "80")
    assert_one_line(done, f"config field '{field}'")
    assert str(model / "config.json") in done.stderr


def test_a_worker_refuses_a_negative_size_before_building(spec_dir, tmp_path) -> None:
    """It was "internal error RuntimeError: Trying to create tensor with negative dimension"."""
    model = _spec_with(spec_dir, tmp_path, hidden_size=-8)
    done = dsv4("prefill", "--model", f"random:{model}", "--device", "cpu", env=SECRET)
    assert_one_line(done, "config field 'hidden_size' = -8")


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt-ids", "1"],
        ["plan", "--gpu-mem", "80"],
        ["prefill", "--device", "cpu"],
    ],
)
@pytest.mark.parametrize("model", ["", "random:"])
def test_an_empty_model_is_refused_not_read_from_the_current_dir(argv, model) -> None:
    done = dsv4(argv[0], "--model", model, *argv[1:], env=SECRET)
    assert_one_line(done, "checkpoint dir")
    assert "'config.json'" not in done.stderr and "shape" not in done.stderr, done.stderr


def test_make_tiny_refuses_layers_of_no_ratio(tmp_path: Path) -> None:
    """`--layers ,,,` wrote a 0-layer checkpoint (exit 0) that generate then failed on."""
    done = dsv4("make-tiny", str(tmp_path / "t"), "--layers", ",,,")
    assert_one_line(done, "--layers ',,,'")
    assert not (tmp_path / "t").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without a CUDA device")
def test_a_cuda_device_on_a_host_without_one_is_a_user_error(spec_dir) -> None:
    """It was "internal error AssertionError: Torch not compiled with CUDA enabled"."""
    done = dsv4("decode", "--model", f"random:{spec_dir}", "--device", "cuda:0", env=SECRET)
    assert_one_line(done, "'model.device' = 'cuda:0'")


# ---- folders and files a command writes -----------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--cache-dir", ""], "--cache-dir ''"),  # wrote tiny-seed0 into the current dir
        (["--cache-dir", "{file}"], "--cache-dir {file}"),  # "[Errno 17] File exists"
        (["--log-dir", "{file}"], "--log-dir {file}"),
    ],
)
def test_up_refuses_a_folder_it_cannot_write_naming_the_flag(flags, names, tmp_path) -> None:
    file = tmp_path / "a-file"
    file.write_text("x")
    done = dsv4("up", "--device", "cpu", *[f.format(file=file) for f in flags], cwd=tmp_path)
    assert_one_line(done, names.format(file=file))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_indexcache_search_refuses_an_out_that_is_a_directory(spec_dir, tmp_path) -> None:
    """It failed after the whole search with "[Errno 21] Is a directory", the report lost."""
    done = dsv4("indexcache-search", "--model", str(spec_dir), "--budget", "1",
                "--out", str(tmp_path))  # fmt: skip
    assert_one_line(done, f"--out {tmp_path}: a directory")


# ---- dsv4 loadtest against an OpenAI-compatible server of a 4096-token context --------------
class ContextServer:
    def __init__(self) -> None:
        self.completions = 0

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 4096, "vocab_size": 1024}]})

    async def complete(self, request: web.Request) -> web.Response:
        self.completions += 1
        return web.json_response({"error": {"message": "not expected"}}, status=500)

    async def start(self):
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1], runner.cleanup  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("flags", "content", "names"),
    [
        (["--dataset-name", "trace"], "[1, 2]\n", "--dataset-path {path}:1: bad Mooncake"),
        (["--dataset-name", "sharegpt"], b"\xff\xfe", "--dataset-path {path}: not UTF-8"),
        (["--dataset-name", "sharegpt"], "{bad", "--dataset-path {path}: not a ShareGPT"),
        (["--random-input-len", "99999999"], None, "max_model_len 4096"),  # ran > 60 s
        (["--save-result", "--result-dir", "{path}"], "x", "--result-dir {path}"),  # after the run
        (["--temperature", "nan"], None, "--temperature"),  # every request refused, exit 1
        (["--trace-time-scale", "nan"], None, "--trace-time-scale nan"),
    ],
)
def test_loadtest_bad_input_is_one_line_before_any_request(flags, content, names, tmp_path):
    path = tmp_path / "data"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    server = ContextServer()
    with serve_in_thread(server.start) as port:
        done = dsv4("loadtest", "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
                    "--num-prompts", "2", "--no-progress", "--dataset-path", str(path),
                    *[f.format(path=path) for f in flags])  # fmt: skip
    assert_one_line(done, names.format(path=path))
    assert server.completions == 0 and done.stdout == ""
