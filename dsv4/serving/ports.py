"""Loopback ports for the processes this project starts (services, rank rendezvous), and the
checks a launcher makes before and after starting a server on one."""

from __future__ import annotations

import errno
import os
import random
import socket
from pathlib import Path

from dsv4.errors import PortInUse, Unavailable

_HANDED_OUT: set[int] = set()
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PICKED_PORT = 10000  # above the ports well-known servers (and users' configs) favour


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now and never handed out before by this process (two services started back
    to back must not both get a port that neither has bound yet), below the kernel's ephemeral
    range where there is room. The service binds the port seconds later, after its imports;
    meanwhile any connection opened on this host gets an ephemeral port as its local end, and
    one did take a worker's metrics port. Below that range only a bind by number can."""
    low = _ephemeral_range()[0]
    if low - LOWEST_PICKED_PORT >= 1024:
        pick = random.SystemRandom()
        for _ in range(200):
            port = pick.randrange(LOWEST_PICKED_PORT, low)
            if port not in _HANDED_OUT and not bind_problem(host, port):
                _HANDED_OUT.add(port)
                return port
    for _ in range(100):  # a host whose ephemeral range starts low: one the kernel picks
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise Unavailable("no fresh free port after 100 tries")


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel gives connections' local ends (Linux's default where /proc says
    nothing)."""
    try:
        low, high = (int(n) for n in Path(EPHEMERAL_RANGE).read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def reserve_port(port: int) -> None:
    """Never hand out `port` from `free_port` (a port the launcher gives a service itself)."""
    _HANDED_OUT.add(port)


def bind_problem(host: str, port: int) -> str:
    """Why a server could not listen on `host:port` now, in a few words; "" when it could.
    A bind test with SO_REUSEADDR, as gRPC and http.server set it: a port in TIME_WAIT is free,
    one another server listens on is not (on this address or the wildcard one)."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)  # fmt: skip
    except (socket.gaierror, UnicodeError) as exc:
        return f"cannot resolve host {host!r} ({exc})"
    problems = []
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return f"{host}:{port} is already in use"
                problems.append(f"cannot listen on {host}:{port} ({exc.strerror})")
                continue
        return ""  # a server binds every address it can; one is enough
    return problems[0] if problems else f"{host}:{port} resolves to no address"


def listen_failure(host: str, port: int, what: str, fix: str,
                   cause: BaseException | str) -> Unavailable:  # fmt: skip
    """The error for a server that could not listen on `host:port`: `PortInUse` when another
    process holds the port (the OSError says so; gRPC says only that the bind failed, so the
    port is probed), else `Unavailable` with the server's own `cause`."""
    in_use = isinstance(cause, OSError) and cause.errno == errno.EADDRINUSE
    if in_use or (port and bind_problem(host, port).endswith("already in use")):
        return PortInUse(host, port, what, fix)
    return Unavailable(f"cannot {what} on {host}:{port} ({cause}): {fix}")


def owns_listener(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds the socket listening on TCP `port` (Linux: the listener's
    inode in /proc/net/tcp{,6} among the process's fds); None where /proc cannot tell."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == _LISTEN and fields[1].endswith(f":{port:04X}"):
                inodes.add(fields[9])
    if not inodes:
        return None
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False
