"""A bad setting names where the user set it: the DSV4_* variable (and the setting), the YAML
file and key, or the flag; through `load_config` and through the commands, as one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsv4.config import load_config
from dsv4.errors import ConfigError
from tests.unit.test_bad_input_config import PLAN, assert_user_error
from tests.unit.test_cli_errors import run

# (env variable, bad value, its setting): a wrong type, out of range, not a choice, a check
BAD_ENV = [
    ("DSV4_MAX_NUM_SEQS", "abc", "scheduler.max_num_seqs"),
    ("DSV4_MAX_NUM_SEQS", "0", "scheduler.max_num_seqs"),
    ("DSV4_KV_DTYPE", "fp9", "cache.kv_dtype"),
    ("DSV4_DEVICE", "gpu", "model.device"),
]


@pytest.fixture(autouse=True)
def _no_dsv4_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("DSV4_")]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize(("var", "value", "key"), BAD_ENV)
def test_an_env_error_names_the_variable_and_the_setting(var, value, key) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config({}, None, {var: value})
    assert raised.value.message.startswith(f"{var}={value!r}: "), raised.value.message
    assert key in raised.value.message and raised.value.env_var == var
    assert raised.value.field_name == key


@pytest.mark.parametrize(("var", "value", "key"), BAD_ENV)
@pytest.mark.parametrize("command", [PLAN, ["prefill"], ["router"]])
def test_commands_name_the_variable_not_a_flag(var, value, key, command, monkeypatch, capsys):
    monkeypatch.setenv(var, value)
    code, err = run(command, capsys)
    assert_user_error(code, err, f"{var}={value!r}")
    assert key in err and "--" not in err.partition(":")[2], err  # no flag the user never typed


def test_a_flag_still_wins_and_is_named(monkeypatch, capsys) -> None:
    monkeypatch.setenv("DSV4_MAX_NUM_SEQS", "abc")  # overridden by the flag: no error of its own
    assert load_config({"scheduler.max_num_seqs": "4"}, None, {"DSV4_MAX_NUM_SEQS": "abc"})
    code, err = run(["prefill", "--max-num-seqs", "0"], capsys)
    assert_user_error(code, err, "--max-num-seqs 0")
    assert "DSV4_" not in err


def test_a_secret_is_not_shown_where_it_is_named(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("router:\n  api_keys: [7355608]\n")  # a key YAML reads as a number
    with pytest.raises(ConfigError) as raised:
        load_config({}, str(path), {})
    assert str(path) in raised.value.message and "router.api_keys" in raised.value.message
    assert "7355608" not in raised.value.message and "<secret>" in raised.value.message


@pytest.mark.parametrize(
    ("text", "key", "fix"),
    [
        ("scheduler:\n  max_num_seqs: abc\n", "scheduler.max_num_seqs", "must be an integer"),
        ("scheduler:\n  max_num_seqs: 0\n", "scheduler.max_num_seqs", "must be >= 1"),
        ("cache:\n  kv_dtype: fp9\n", "cache.kv_dtype", "use one of"),
        ("schedular:\n  max_num_seqs: 3\n", "schedular", "unknown config section"),
    ],
)
def test_a_yaml_error_names_the_file_and_the_key(text, key, fix, tmp_path: Path, capsys):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load_config({}, str(path), {})
    assert str(path) in raised.value.message and key in raised.value.message
    assert fix in raised.value.message
    for command in ([*PLAN, "--config", str(path)], ["prefill", "--config", str(path)]):
        code, err = run(command, capsys)
        assert_user_error(code, err, f"YAML file {path}, {key}")


def test_a_mistyped_variable_is_named_without_its_value() -> None:
    """An unknown DSV4_* variable may be a secret under a misspelt name: the error names the
    variable and the likely setting, never the value."""
    with pytest.raises(ConfigError) as raised:
        load_config({}, None, {"DSV4_SHARED_SECRTE": "hunter2-token"})
    assert "DSV4_SHARED_SECRTE" in raised.value.message
    assert "hunter2-token" not in raised.value.message
