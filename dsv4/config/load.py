"""Build a ServeConfig from layers: defaults < YAML file < DSV4_* env vars < CLI flags.

Each layer maps dotted keys (`cache.block_size`) to raw values; strings are coerced to the
field's type here, and every error is a ConfigError naming the field, the value and the fix.
This module is the only reader of environment variables, and only through the `env` argument.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from dsv4.config.fields import ENV_PREFIX, FieldSpec, iter_specs
from dsv4.config.sections import ServeConfig
from dsv4.errors import ConfigError

CONFIG_PATH_ENV = "DSV4_CONFIG"  # names the YAML file when --config is not given

SPECS: dict[str, FieldSpec] = {spec.key: spec for _, _, spec in iter_specs(ServeConfig)}
SPECS_BY_ENV: dict[str, FieldSpec] = {spec.env_var: spec for spec in SPECS.values()}
SECTION_CLASSES: dict[str, type] = {name: cls for name, cls, _ in iter_specs(ServeConfig)}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", re.IGNORECASE)
_SIZE_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SIZE_UNITS |= {"ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def load_config(
    argv_overrides: Mapping[str, Any] | None = None,
    yaml_path: str | None = None,
    env: Mapping[str, str] | None = None,
) -> ServeConfig:
    """Layer defaults < YAML < env < argv_overrides ({"cache.block_size": 64, ...}).

    A bad value set by the YAML file or an environment variable raises a ConfigError naming
    that file and key, or that variable, as the user wrote them (argv_overrides: the caller
    names its flags, `dsv4.config.cli.config_from_args`)."""
    merged: dict[str, tuple[Any, dict[str, str]]] = {}  # key -> (raw value, who set it)
    for key, raw in (yaml_layer(yaml_path) if yaml_path else {}).items():
        merged[key] = (raw, {"yaml_path": str(yaml_path)})
    for key, raw in env_layer(env or {}).items():
        merged[key] = (raw, {"env_var": SPECS[key].env_var})
    for key, raw in _known_keys(argv_overrides or {}, "command line").items():
        merged[key] = (raw, {})
    by_section: dict[str, dict[str, Any]] = {name: {} for name in SECTION_CLASSES}
    try:
        for key, (raw, _) in merged.items():
            spec = SPECS[key]
            by_section[spec.section][spec.name] = coerce(spec, raw)
        return ServeConfig(**{name: SECTION_CLASSES[name](**v) for name, v in by_section.items()})
    except ConfigError as exc:
        raw, origin = merged.get(exc.field_name, (None, {}))
        if not origin:
            raise
        shown = "<secret>" if SPECS[exc.field_name].is_secret else raw
        raise ConfigError(exc.field_name, shown, exc.fix, **origin) from exc


def yaml_layer(path: str | Path) -> dict[str, Any]:
    """Flatten a YAML file of `section: {field: value}` mappings into dotted keys."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(
            "config", str(path), f"cannot read the YAML file: {exc.strerror}"
        ) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            "config",
            str(path),
            f"not UTF-8 text ({exc.reason} at byte {exc.start}): give a YAML file",
        ) from exc
    except yaml.YAMLError as exc:
        raise ConfigError("config", str(path), f"not valid YAML: {_yaml_problem(exc)}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config", str(path), "the YAML top level must map section names")
    flat: dict[str, Any] = {}
    for section, fields in data.items():
        if section not in SECTION_CLASSES:
            hint = _did_you_mean(str(section), SECTION_CLASSES)
            fix = f"unknown config section{hint}"
            raise ConfigError(str(section), fields, fix, yaml_path=str(path))
        if not isinstance(fields, dict):
            fix = "a section must map field names to values"
            raise ConfigError(str(section), fields, fix, yaml_path=str(path))
        for name, value in (fields or {}).items():
            flat[f"{section}.{name}"] = value
    return _known_keys(flat, f"YAML file {path}")


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error as one line: its problem and where (its own text quotes the offending
    line with a caret under it, several lines that a log line or a terminal would split)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return " ".join(f"{problem}{where}".split())


def env_layer(env: Mapping[str, str]) -> dict[str, Any]:
    """DSV4_* variables (DSV4_ + the flag name, e.g. DSV4_BLOCK_SIZE); unknown ones are errors."""
    flat: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name == CONFIG_PATH_ENV:
            continue
        spec = SPECS_BY_ENV.get(name)
        if spec is None:
            hint = _did_you_mean(name, SPECS_BY_ENV)
            fix = f"unknown variable{hint}; every DSV4_* variable must name a config field"
            # its value is not shown: a mistyped secret's name (DSV4_SHARED_SECRTE) must not
            # put the secret into the error, the logs or a terminal
            raise ConfigError(name, "<not shown>", fix, env_var=name)
        flat[spec.key] = raw
    return flat


def _known_keys(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    for key in values:
        if key not in SPECS:
            raise ConfigError(
                key, values[key], f"unknown field in {source}{_did_you_mean(key, SPECS)}"
            )
    return dict(values)


def _did_you_mean(name: str, known: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def coerce(spec: FieldSpec, raw: Any) -> Any:
    """Turn a raw layer value (string from env/CLI, typed from YAML) into the field's type;
    ConfigError naming the field (`load_config` names the layer that set it)."""
    shown = "<secret>" if spec.is_secret else raw
    expected = {bool: "true/false", int: "an integer", float: "a number"}.get(spec.type, "")
    try:
        if spec.type is bool:
            return _to_bool(raw)
        if spec.type is int:
            return _to_int(raw, allow_size=spec.name.endswith("_bytes"))
        if spec.type is float:
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
        if spec.type is tuple:
            return _to_str_tuple(raw)
        if not isinstance(raw, str):
            raise ValueError
        return raw
    except (ValueError, TypeError):
        expected = expected or ("a list of strings" if spec.type is tuple else "a string")
        raise ConfigError(spec.key, shown, f"must be {expected}") from None


def _to_bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError


def _to_int(raw: Any, *, allow_size: bool) -> int:
    if isinstance(raw, bool | float):
        raise ValueError
    if isinstance(raw, int):
        return raw
    text = str(raw).strip()
    match = _SIZE.fullmatch(text) if allow_size else None
    if match and match.group(2):
        unit = match.group(2).lower().removesuffix("b")
        return int(float(match.group(1)) * _SIZE_UNITS[unit])
    return int(text)


def _to_str_tuple(raw: Any) -> tuple[str, ...]:
    items = [raw] if isinstance(raw, str) else list(raw)
    out: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError
        out.extend(part.strip() for part in item.split(",") if part.strip())
    return tuple(out)


def config_to_dict(config: ServeConfig, *, redact_secrets: bool = True) -> dict[str, Any]:
    """Plain nested dict (lists for tuples), YAML-ready; secrets shown as '<redacted>'."""
    out: dict[str, Any] = {}
    for name in SECTION_CLASSES:
        section = getattr(config, name)
        fields: dict[str, Any] = {}
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if redact_secrets and SPECS[f"{name}.{f.name}"].is_secret and value:
                value = "<redacted>"
            elif redact_secrets and isinstance(value, str):
                value = _redact_url_password(value)  # redis://:PASSWORD@host (deploy/k8s)
            fields[f.name] = list(value) if isinstance(value, tuple) else value
        out[name] = fields
    return out


def config_to_yaml(config: ServeConfig, *, redact_secrets: bool = True) -> str:
    return yaml.safe_dump(config_to_dict(config, redact_secrets=redact_secrets), sort_keys=False)


def _redact_url_password(value: str) -> str:
    """`scheme://user:password@host...` with the password shown as '<redacted>'."""
    parts = urllib.parse.urlsplit(value) if "://" in value else None
    if parts is None or parts.password is None:
        return value
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:<redacted>@{host}"))
