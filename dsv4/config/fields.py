"""How a config field is declared and checked: `setting(...)` and the `Section` base class.

Every field of every section carries its help text, its CLI flag (the env var is derived from
it: `--block-size` -> `DSV4_BLOCK_SIZE`), optional choices and bounds. Sections check those
in `__post_init__`, so a `ServeConfig` built any way (layers, tests) is always valid.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterator
from functools import cache
from typing import Any, ClassVar

from dsv4.errors import ConfigError

ENV_PREFIX = "DSV4_"


def setting(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
    min: float | None = None,
    max: float | None = None,
    secret: bool = False,
) -> Any:
    """Declare a config field: default, one-line help, CLI flag (default `--field-name`)."""
    meta = {"help": help, "flag": flag, "choices": choices, "min": min, "max": max}
    meta["secret"] = secret
    return dataclasses.field(default=default, repr=not secret, metadata=meta)


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """One field of one section, with everything the loaders need to know about it."""

    section: str  # YAML key of the section, e.g. "cache"
    name: str  # field name, e.g. "block_size"
    type: type  # int | float | bool | str | tuple (of str)
    default: Any
    help: str
    flag: str
    choices: tuple[str, ...] | None
    min: float | None
    max: float | None
    is_secret: bool

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.flag.removeprefix("--").replace("-", "_").upper()

    def where(self) -> str:
        return f"YAML {self.key}, flag {self.flag}, env {self.env_var}"


class Section:
    """Base of the frozen section dataclasses: validates declared choices, bounds and types."""

    SECTION: ClassVar[str]

    def __post_init__(self) -> None:
        for spec in field_specs(type(self)):
            check_value(spec, getattr(self, spec.name))
        self.check()

    def check(self) -> None:
        """Cross-field checks of one section; raise ConfigError."""

    def fail(self, name: str, fix: str) -> typing.NoReturn:
        raise ConfigError(f"{self.SECTION}.{name}", getattr(self, name), fix)


@cache
def field_specs(section_cls: type) -> tuple[FieldSpec, ...]:
    hints = typing.get_type_hints(section_cls)
    specs = []
    for f in dataclasses.fields(section_cls):
        raw_type = hints[f.name]
        base = typing.get_origin(raw_type) or raw_type
        specs.append(
            FieldSpec(
                section=section_cls.SECTION,
                name=f.name,
                type=base,
                default=f.default,
                help=f.metadata["help"],
                flag=f.metadata["flag"] or "--" + f.name.replace("_", "-"),
                choices=f.metadata["choices"],
                min=f.metadata["min"],
                max=f.metadata["max"],
                is_secret=f.metadata["secret"],
            )
        )
    return tuple(specs)


def check_value(spec: FieldSpec, value: Any) -> None:
    """Raise ConfigError naming the field, the value and the fix."""
    shown = "<secret>" if spec.is_secret else value
    if not _has_type(value, spec.type):
        raise ConfigError(spec.key, shown, f"must be {_type_name(spec.type)} ({spec.where()})")
    if spec.choices is not None and value not in spec.choices:
        raise ConfigError(spec.key, shown, f"use one of {', '.join(spec.choices)}")
    # NaN compares false with every bound and inf passes a min: both would start a service
    # whose every use of the value fails (no setting takes inf for "no limit": 0 says that)
    if spec.type is float and not math.isfinite(value):
        raise ConfigError(spec.key, shown, f"must be a finite number{_bounds(spec)}")
    if spec.min is not None and value < spec.min:
        raise ConfigError(spec.key, shown, f"must be >= {_number(spec.min)}")
    if spec.max is not None and value > spec.max:
        raise ConfigError(spec.key, shown, f"must be <= {_number(spec.max)}")


def _bounds(spec: FieldSpec) -> str:
    if spec.min is not None and spec.max is not None:
        return f" in [{_number(spec.min)}, {_number(spec.max)}]"
    if spec.min is not None:
        return f" >= {_number(spec.min)}"
    return f" <= {_number(spec.max)}" if spec.max is not None else ""


def _number(bound: float) -> str:
    """A bound as written: ints whole (a seed's 2**64 - 1 is no 1.84467e+19), floats short."""
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def _has_type(value: Any, expected: type) -> bool:
    if expected is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is tuple:
        return isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    return isinstance(value, expected)


def _type_name(expected: type) -> str:
    return {tuple: "a list of strings", bool: "true or false"}.get(expected, expected.__name__)


def iter_specs(config_cls: type) -> Iterator[tuple[str, type, FieldSpec]]:
    """(section attribute, section class, field spec) for every field of a config tree."""
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        section_cls = hints[f.name]
        for spec in field_specs(section_cls):
            yield f.name, section_cls, spec
