"""Loopback ports for the processes this project starts (services, rank rendezvous)."""

from __future__ import annotations

import socket

from dsv4.errors import Unavailable

_HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now and never handed out before by this process: two services started
    back to back must not both get a port that neither has bound yet."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise Unavailable("no fresh free port after 100 tries")
