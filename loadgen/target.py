"""Where the load goes: the target flags (ours and `vllm bench serve`'s spellings) resolved to
one validated endpoint before anything is sent, and a reachability probe, so a closed port
ends the run in well under a second with one line instead of a table of failures.

Precedence: `--base-url` (http://HOST:PORT[/prefix]), else `--host` / `--port`, else
`--target HOST:PORT`, else 127.0.0.1 on the backend's default port (gRPC 50051, HTTP 8000 as
vLLM). HTTP backends append `--endpoint` (default /v1/completions or /v1/chat/completions).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

DEFAULT_PORTS = {"grpc": 50051, "openai": 8000, "openai-chat": 8000}
DEFAULT_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
REACH_TIMEOUT_S = 3.0
# An HTTP/2 client's first bytes: the connection preface and an empty SETTINGS frame.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
H2_SETTINGS_FRAME_TYPE = 4


class LoadtestConfigError(ValueError):
    """A flag value is wrong; the message names the flag, the value and the fix."""


class TargetUnreachable(OSError):
    """Nothing answers at the target: the run is not started."""


@dataclass(frozen=True)
class Endpoint:
    target: str  # HOST:PORT (IPv6 hosts in brackets)
    url: str = ""  # the full HTTP endpoint URL; "" for gRPC
    models_url: str = ""  # the server's /v1/models (HTTP only)


def parse_host_port(text: str, flag: str, default_port: int) -> tuple[str, int]:
    """("host", port) from HOST:PORT or [V6]:PORT; LoadtestConfigError otherwise."""
    host, sep, port = text.strip().rpartition(":")
    hint = f"expected HOST:PORT, e.g. 127.0.0.1:{default_port}"
    if not sep or not host or not port.isdigit() or (":" in host and not host.startswith("[")):
        raise LoadtestConfigError(f"{flag} {text!r}: {hint}")
    if not 0 < int(port) < 65536:
        raise LoadtestConfigError(f"{flag} {text!r}: the port must be in 1..65535")
    return host, int(port)


def _from_base_url(base_url: str, backend: str, endpoint: str) -> Endpoint:
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LoadtestConfigError(
            f"--base-url {base_url!r}: expected http(s)://HOST[:PORT], e.g. http://127.0.0.1:8000"
        )
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise LoadtestConfigError(
            f"--base-url {base_url!r}: the port must be in 1..65535"
        ) from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    root = f"{parts.scheme}://{host}:{port}{parts.path.rstrip('/')}"
    return Endpoint(f"{host}:{port}", f"{root}{endpoint}", f"{root}/v1/models")


def resolve_endpoint(
    backend: str,
    target: str | None,
    host: str | None,
    port: int | None,
    base_url: str | None,
    endpoint: str | None,
    use_tls: bool = False,
) -> Endpoint:
    """The one endpoint the flags name; LoadtestConfigError for missing ports or conflicts."""
    given = [f for f, v in (("--target", target), ("--base-url", base_url)) if v]
    if host is not None or port is not None:
        given.append("--host/--port")
    if len(given) > 1:
        raise LoadtestConfigError(f"{' and '.join(given)}: give only one way to name the server")
    if backend == "grpc" and (base_url or endpoint):
        raise LoadtestConfigError(
            "--base-url / --endpoint name an HTTP server: add --backend openai (or openai-chat), "
            "or give the router as --target HOST:PORT"
        )
    path = endpoint or DEFAULT_ENDPOINTS.get(backend, "")
    if path and not path.startswith("/"):
        raise LoadtestConfigError(f"--endpoint {endpoint!r}: expected a path like /v1/completions")
    if base_url:
        return _from_base_url(base_url, backend, path)
    default_port = DEFAULT_PORTS[backend]
    if target:
        name, number = parse_host_port(target, "--target", default_port)
    else:
        name, number = host or "127.0.0.1", default_port if port is None else port
        if ":" in name and not name.startswith("["):
            name = f"[{name}]"
        if not 0 < number < 65536:
            raise LoadtestConfigError(f"--port {number}: must be in 1..65535")
    address = f"{name}:{number}"
    if backend == "grpc":
        return Endpoint(address)
    root = f"{'https' if use_tls else 'http'}://{address}"
    return Endpoint(address, f"{root}{path}", f"{root}/v1/models")


async def check_tcp_reachable(target: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Raise TargetUnreachable unless something accepts a TCP connection at HOST:PORT."""
    host, _, port = target.rpartition(":")
    try:
        connect = asyncio.open_connection(host.strip("[]"), int(port))
        _, writer = await asyncio.wait_for(connect, timeout_s)
    except TimeoutError:
        reason = f"no answer in {timeout_s:g} s"
        raise TargetUnreachable(unreachable_message(target, reason)) from None
    except OSError as exc:  # refused, no route, unknown host (errno < 0: a resolver error)
        reason = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else exc.strerror
        raise TargetUnreachable(unreachable_message(target, reason or str(exc))) from None
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def sniff_protocol(target: str, timeout_s: float = REACH_TIMEOUT_S) -> str:
    """What plaintext protocol the server at HOST:PORT answers an HTTP/2 preface with: "http1"
    (an HTTP/1.x status line: an HTTP server such as the OpenAI front), "http2" (a SETTINGS
    frame: a gRPC server) or "" (no answer, TLS, anything else). Only asked after a failure:
    an HTTP/1 server logs the preface as a bad request."""
    host, _, port = target.rpartition(":")
    writer = None
    try:
        connect = asyncio.open_connection(host.strip("[]"), int(port))
        reader, writer = await asyncio.wait_for(connect, timeout_s)
        writer.write(H2_PREFACE)
        head = await asyncio.wait_for(reader.read(16), timeout_s)
    except (OSError, TimeoutError, ValueError):
        return ""
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    if head.startswith(b"HTTP/"):
        return "http1"
    if len(head) >= 4 and head[3] == H2_SETTINGS_FRAME_TYPE:
        return "http2"
    return ""


def not_grpc_message(target: str) -> str:
    return f"{target} does not speak gRPC (is it the HTTP front? use --backend openai)"


def not_http_message(target: str) -> str:
    return f"{target} speaks gRPC, not HTTP (is it the router's gRPC port? use --backend grpc)"


def unreachable_message(target: str, reason: str) -> str:
    return f"cannot reach {target} ({reason}): is the server up? (check --target / --base-url)"
