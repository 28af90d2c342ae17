"""Bad input an outside QA run found (NaN and inf settings, negative layouts, malformed model
files, seeds past uint64, non-UTF-8 files, an empty OUT_DIR, a closed stdout pipe): each is
one line on stderr naming the flag or file, exit status 2, never an internal error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4.commands.cli import DEBUG_ENV, build_parser
from dsv4.config import load_config
from dsv4.config.load import SPECS
from dsv4.config.model import ModelConfig
from dsv4.config.sections import SEED_LIMIT
from dsv4.errors import ConfigError
from tests.unit.test_cli_errors import run

REPO = Path(__file__).resolve().parents[2]
PLAN = ["plan", "--shape", "flash", "--gpu-mem", "80"]
FLOATS = sorted(key for key, spec in SPECS.items() if spec.type is float)


@pytest.fixture(autouse=True)
def _no_dsv4_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("DSV4_")]:
        monkeypatch.delenv(name)  # the config's env layer must not fill in a value


@pytest.fixture(scope="module")
def spec_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dsv4.model.tiny import tiny_config, write_model_spec

    return write_model_spec(tmp_path_factory.mktemp("spec"), tiny_config())


@pytest.fixture
def binary(tmp_path: Path) -> str:
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\x00\xff\xfe")
    return str(path)


def assert_user_error(code: int, err: str, names: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert names in lines[0] and "internal error" not in err and "Traceback" not in err, err


# ---- 1: NaN and inf ------------------------------------------------------------------------
@pytest.mark.parametrize("key", FLOATS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_setting_refuses_nan_and_inf_from_every_layer(key: str, value: str) -> None:
    spec = SPECS[key]
    for layer in ({"argv_overrides": {key: value}}, {"env": {spec.env_var: value}}):
        with pytest.raises(ConfigError, match="must be a finite number") as raised:
            load_config(**layer)
        assert raised.value.field_name == key


def test_yaml_nan_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "nan.yaml"
    path.write_text("router:\n  prefill_timeout_s: .nan\ncache:\n  memory_fraction: .inf\n")
    with pytest.raises(ConfigError, match="finite"):
        load_config({}, str(path), {})


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["router", "--request-timeout-s", "nan"], "--request-timeout-s nan"),
        (["router", "--prefill-timeout-s", "nan"], "--prefill-timeout-s nan"),
        (["router", "--memory-fraction", "nan"], "--memory-fraction nan"),
        (["decode", "--drain-timeout-s", "inf"], "--drain-timeout-s inf"),
        ([*PLAN, "--memory-fraction", "nan"], "--memory-fraction"),
        ([*PLAN, "--host-mem", "inf"], "--host-mem"),
    ],
)
def test_nan_and_inf_flags_are_one_line_naming_the_flag(argv, flag, capsys) -> None:
    code, err = run(argv, capsys)
    assert_user_error(code, err, flag)
    assert "finite" in err


def test_env_inf_stops_the_router(monkeypatch, capsys) -> None:
    monkeypatch.setenv("DSV4_REQUEST_TIMEOUT_S", "inf")
    assert_user_error(*run(["router"], capsys), "router.request_timeout_s")


def test_finite_values_and_bounds_still_pass() -> None:
    config = load_config({"cache.memory_fraction": "1", "router.rate_limit_rps": "0"}, None, {})
    assert config.cache.memory_fraction == 1.0 and config.router.rate_limit_rps == 0.0
    with pytest.raises(ConfigError, match=r"in \[0.01, 1\]"):
        load_config({"cache.memory_fraction": "nan"}, None, {})


# ---- 2: `dsv4 plan` layouts and sizes ------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--gpus", "8", "--ep", "-1"], "--ep"),
        (["--gpus", "8", "--tp", "-1"], "--tp"),
        (["--gpus", "-8"], "--gpus"),
        (["--gpus", "8", "--gpus-per-node", "-1"], "--gpus-per-node"),
        (["--cache-slots", "-3"], "--cache-slots"),
        (["--gpu-mem", "1e300"], "--gpu-mem"),
        (["--gpu-mem", "inf"], "--gpu-mem"),
        (["--host-mem", "1e300"], "--host-mem"),
    ],
)
def test_plan_refuses_negative_layouts_and_absurd_sizes(extra, flag, capsys) -> None:
    assert_user_error(*run([*PLAN, *extra], capsys), flag)


def test_plan_still_takes_zero_for_derived_layouts(capsys) -> None:
    code, _ = run([*PLAN, "--gpus", "8", "--tp", "0", "--ep", "0", "--cache-slots", "0"], capsys)
    assert code in (0, 1)  # a verdict, not a usage error


# ---- 3: malformed config.json / tokenizer.json ---------------------------------------------
def _checkpoint(tmp_path: Path, spec_dir: Path, config: str | None, tokenizer: str | None) -> str:
    out = tmp_path / "ckpt"
    out.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (out / name).write_bytes((spec_dir / name).read_bytes())
    if config is not None:
        (out / "config.json").write_text(config)
    if tokenizer is not None:
        (out / "tokenizer.json").write_text(tokenizer)
    return str(out)


@pytest.mark.parametrize(
    ("config", "tokenizer", "names"),
    [
        ("[1, 2]", None, "must hold an object, not a list"),
        ('{"hidden_size": 64}', None, "lacks num_hidden_layers, compress_ratios"),
        ('{"num_hidden_layers": "x", "compress_ratios": [0]}', None, "malformed value"),
        ('{"num_hidden_layers": 1, "compress_ratios": [0], "o_groups": 0}', None, "malformed"),
        (None, "garbage", "tokenizer.json"),
    ],
    ids=["list", "missing-keys", "string-count", "zero-divisor", "garbage-tokenizer"],
)
def test_a_malformed_model_file_is_a_user_error_naming_it(
    config, tokenizer, names, spec_dir, tmp_path, capsys
) -> None:
    ckpt = _checkpoint(tmp_path, spec_dir, config, tokenizer)
    code, err = run(["generate", "--model", ckpt, "--prompt-ids", "1"], capsys)
    assert_user_error(code, err, names)
    assert ckpt in err
    if config is not None:  # plan reads config.json only
        assert_user_error(*run(["plan", "--model", ckpt, "--gpu-mem", "80"], capsys), names)


def test_model_config_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)
    path.write_text('{"num_hidden_layers": 1, "compress_ratios": [3]}')
    with pytest.raises(ConfigError, match=f"0, 4 or 128 \\(in {path}\\)"):
        ModelConfig.from_file(tmp_path)


# ---- 4: seeds ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [str(SEED_LIMIT), "99999999999999999999999", "-1"])
@pytest.mark.parametrize("command", ["make-tiny", "train-tiny", "generate"])
def test_seeds_outside_uint64_are_refused(command, seed, spec_dir, tmp_path, capsys) -> None:
    argv = {
        "make-tiny": ["make-tiny", str(tmp_path / "t"), "--seed", seed],
        "train-tiny": ["train-tiny", str(tmp_path / "t"), "--steps", "1", "--seed", seed],
        "generate": ["generate", "--model", str(spec_dir), "--prompt-ids", "1",
                     "--temperature", "1", "--seed", seed],
    }[command]  # fmt: skip
    assert_user_error(*run(argv, capsys), "--seed")
    assert not (tmp_path / "t").exists()  # refused before anything is written


def test_the_largest_uint64_seed_parses() -> None:
    args = build_parser().parse_args(
        ["generate", "--model", "m", "--prompt-ids", "1", "--seed", str(SEED_LIMIT - 1)]
    )
    assert args.seed == SEED_LIMIT - 1
    assert load_config({"model.seed": str(SEED_LIMIT - 1)}, None, {}).model.seed == SEED_LIMIT - 1
    with pytest.raises(ConfigError, match=f"<= {SEED_LIMIT - 1}"):
        load_config({"model.seed": str(SEED_LIMIT)}, None, {})


# ---- 5: non-UTF-8 files and YAML errors ----------------------------------------------------
@pytest.mark.parametrize("command", [["router"], PLAN, ["decode"]])
def test_a_binary_config_file_is_one_line_naming_it(command, binary, capsys) -> None:
    code, err = run([*command, "--config", binary], capsys)
    assert_user_error(code, err, binary)
    assert "UTF-8" in err


def test_a_binary_config_from_the_environment(binary, monkeypatch, capsys) -> None:
    monkeypatch.setenv("DSV4_CONFIG", binary)
    assert_user_error(*run(PLAN, capsys), binary)


def test_a_binary_calibration_file(binary, spec_dir, capsys) -> None:
    argv = ["indexcache-search", "--model", str(spec_dir), "--budget", "1", "--calib", binary]
    assert_user_error(*run(argv, capsys), f"--calib {binary}")


def test_a_yaml_syntax_error_is_one_line(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("router:\n  port: [1\n  x: {\n")
    code, err = run(["router", "--config", str(path)], capsys)
    assert_user_error(code, err, str(path))
    assert "line 3, column 4" in err


# ---- 6: an empty OUT_DIR -------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["make-tiny", ""], ["train-tiny", "", "--steps", "1"]])
def test_an_empty_out_dir_is_refused(argv, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert_user_error(*run(argv, capsys), "OUT_DIR ''")
    assert list(tmp_path.iterdir()) == []  # nothing written into the current directory


def test_train_tiny_needs_a_finite_budget_without_steps(tmp_path, capsys) -> None:
    code, err = run(["train-tiny", str(tmp_path / "t"), "--minutes", "inf"], capsys)
    assert_user_error(code, err, "--minutes inf")


# ---- 7: a closed stdout pipe ---------------------------------------------------------------
def test_a_closed_stdout_pipe_ends_quietly() -> None:
    """`dsv4 plan --json | head -c 1`: the reader is gone before the plan is printed."""
    env = {k: v for k, v in os.environ.items() if k != DEBUG_ENV and not k.startswith("DSV4_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsv4.commands.cli", *PLAN, "--json"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    proc.stdout.close()  # type: ignore[union-attr]
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert err == b"", err


def test_json_on_the_pipe_still_arrives_whole() -> None:
    env = {k: v for k, v in os.environ.items() if k != DEBUG_ENV and not k.startswith("DSV4_")}
    result = subprocess.run(
        [sys.executable, "-m", "dsv4.commands.cli", *PLAN, "--json"],
        cwd=REPO, env=env, capture_output=True, timeout=120,
    )  # fmt: skip
    assert result.returncode in (0, 1) and json.loads(result.stdout)["verdict"]
