"""What the flags `dsv4 up` passes on mean to the services it starts.

`dsv4 up` forwards the flags it does not know to every service; before starting any, the launcher
reads them as a service would: the config a service builds from them (`service_config`), the
flags no service knows (`unknown_service_flags`), the shared secret (`split_secret` takes
`--shared-secret` off the command line, where `ps` would show it; `configured_secret` is the one
from the environment or a `--config` YAML) and the gRPC client credentials that match the
services' TLS flags (`channel_credentials`). Kept apart from `dsv4.commands.cluster`, which
runs the processes, since layout planning, the tests and the benchmarks read service flags
without starting a cluster.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from dsv4.errors import UsageError

if TYPE_CHECKING:
    from dsv4.config import ServeConfig

SECRET_FLAG = "--shared-secret"


def split_secret(service_args: tuple[str, ...]) -> tuple[tuple[str, ...], str]:
    """(`service_args` without `--shared-secret S`, S or ""): the services get S in their
    environment instead, where `ps` does not show it."""
    kept: list[str] = []
    secret = ""
    args = iter(service_args)
    for arg in args:
        if arg == SECRET_FLAG:
            secret = next(args, "")
        elif arg.startswith(SECRET_FLAG + "="):
            secret = arg.partition("=")[2]
        else:
            kept.append(arg)
    return tuple(kept), secret


def configured_secret(service_args: tuple[str, ...]) -> str:
    """The shared secret the services would read from the environment or a `--config` YAML."""
    return service_config(service_args, os.environ).security.shared_secret


def service_config(service_args: tuple[str, ...], env: Mapping[str, str]) -> ServeConfig:
    """The config a service started with `service_args` and `env` reads (argparse: a repeated
    flag's last value wins; flags it does not know are left aside), before `resolve_auto`;
    `UsageError` for a value the service would refuse to parse."""
    from dsv4.config import config_from_args

    args, _ = _service_parser().parse_known_args(list(service_args))
    return config_from_args(args, env)


def unknown_service_flags(service_args: tuple[str, ...]) -> list[str]:
    """The `service_args` no service knows (each would exit 2 on them)."""
    return _service_parser().parse_known_args(list(service_args))[1]


def _service_parser() -> argparse.ArgumentParser:
    from dsv4.config import add_config_args

    parser = RaisingParser(add_help=False)
    add_config_args(parser)
    return parser


class RaisingParser(argparse.ArgumentParser):
    """argparse whose errors are a `UsageError` (one line), not the usage and an exit."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        raise UsageError(message)


def channel_credentials(service_args: tuple[str, ...]) -> object:
    """Client credentials matching the services' security flags (None: plaintext): the CA of
    `--tls-ca`, and with `--require-client-cert` the services' own key pair as client cert."""
    import grpc

    s = service_config(service_args, {}).security
    if not s.tls_cert_path:
        return None
    root = Path(s.tls_ca_path).read_bytes() if s.tls_ca_path else None
    if not s.require_client_cert:
        return grpc.ssl_channel_credentials(root)
    key, cert = Path(s.tls_key_path).read_bytes(), Path(s.tls_cert_path).read_bytes()
    return grpc.ssl_channel_credentials(root, key, cert)
