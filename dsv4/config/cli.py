"""argparse glue: every entry point (router, prefill, decode, up, demo, generate) calls
`add_config_args(parser)` and, after parsing, `config_from_args(args, os.environ)` once.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from dsv4.config.load import CONFIG_PATH_ENV, SPECS, load_config
from dsv4.config.sections import ServeConfig
from dsv4.errors import ConfigError

CONFIG_PATH_DEST = "config_path"


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """Add `--config PATH` and one flag per config field, grouped by section.

    Flags default to "not given" (argparse.SUPPRESS), so only what the user typed overrides
    the lower layers. Booleans get `--x/--no-x`; lists are repeatable or comma-separated.
    """
    parser.add_argument(
        "--config",
        dest=CONFIG_PATH_DEST,
        metavar="PATH",
        default=argparse.SUPPRESS,
        help=f"YAML config file (env {CONFIG_PATH_ENV}); layers: defaults < YAML < env < flags",
    )
    groups: dict[str, Any] = {}
    for spec in SPECS.values():
        if spec.section not in groups:
            groups[spec.section] = parser.add_argument_group(f"{spec.section} options")
        group = groups[spec.section]
        shown_default = "<secret>" if spec.is_secret else spec.default
        help_text = f"{spec.help} [default {shown_default!r}; env {spec.env_var}]"
        if spec.choices:
            help_text = f"{'|'.join(spec.choices)}: {help_text}"
        kwargs: dict[str, Any] = {"dest": spec.key, "default": argparse.SUPPRESS, "help": help_text}
        if spec.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif spec.type is tuple:
            kwargs |= {"action": "append", "metavar": "VALUE"}
        else:
            kwargs["metavar"] = spec.type.__name__.upper()
        group.add_argument(spec.flag, **kwargs)


def config_from_args(
    args: argparse.Namespace,
    env: Mapping[str, str],
    *,
    forced: Mapping[str, Any] | None = None,
) -> ServeConfig:
    """The ServeConfig of this process: defaults < YAML < env < flags < `forced`.

    `forced` holds values the entry point itself decides (`{"worker.role": "prefill"}` for
    `dsv4 prefill`), which no layer may change.
    """
    given = {key: value for key, value in vars(args).items() if key in SPECS}
    yaml_path = getattr(args, CONFIG_PATH_DEST, None) or env.get(CONFIG_PATH_ENV) or None
    try:
        return load_config({**given, **(forced or {})}, yaml_path, env)
    except ConfigError as exc:
        if exc.field_name not in given or exc.field_name in (forced or {}):
            raise
        flag = SPECS[exc.field_name].flag
        raise ConfigError(exc.field_name, exc.value, exc.fix, flag=flag) from exc
