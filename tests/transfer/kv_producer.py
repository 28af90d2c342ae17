"""The prefill side (P) of the transport contract tests, in-process or in a spawned child process.

Both producers offer the same small API: endpoint(), export(), release(), pulled(), usage(),
kill() and close(). The child process owns P's tensor (a seeded random pattern the test can
recreate), answers commands over a pipe and calls `transport.progress()` between them, as the
prefill service's thread would.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
from dataclasses import dataclass

import torch

from dsv4 import errors
from dsv4.errors import Dsv4Error
from dsv4.transfer import ExportedBlocks, TransportEndpoint, TransportUsage, make_transport

logger = logging.getLogger(__name__)

REPLY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Geometry:
    num_blocks: int
    block_stride_bytes: int
    seed: int = 1234


def make_pattern(geometry: Geometry, device: str = "cpu") -> torch.Tensor:
    """P's backing contents: `[num_blocks, block_stride_bytes]` uint8, deterministic."""
    generator = torch.Generator().manual_seed(geometry.seed)
    shape = (geometry.num_blocks, geometry.block_stride_bytes)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator).to(device)


class InProcessProducer:
    def __init__(self, kind: str, geometry: Geometry, device: str = "cpu") -> None:
        self.transport = make_transport(kind)
        self.transport.register(make_pattern(geometry, device))
        self._pulled: list[str] = []

    def endpoint(self) -> TransportEndpoint:
        return self.transport.endpoint()

    def export(self, request_id: str, block_ids: list[int], bytes_per_block: int | None = None):
        return self.transport.export(request_id, block_ids, bytes_per_block)

    def release(self, request_id: str) -> bool:
        return self.transport.release(request_id)

    def pulled(self) -> list[str]:
        return self.transport.progress()

    def usage(self) -> TransportUsage:
        return self.transport.usage()

    def kill(self) -> None:
        """The in-process equivalent of a dead peer: its transport closes."""
        self.transport.close()

    def close(self) -> None:
        self.transport.close()


class ChildProducer:
    def __init__(self, kind: str, geometry: Geometry, device: str = "cpu") -> None:
        context = mp.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_child_main, args=(kind, geometry, device, child_conn), daemon=True
        )
        self._process.start()
        child_conn.close()
        self._endpoint = TransportEndpoint.from_bytes(self._call("endpoint"))

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    def endpoint(self) -> TransportEndpoint:
        return self._endpoint

    def export(self, request_id: str, block_ids: list[int], bytes_per_block: int | None = None):
        return ExportedBlocks.from_bytes(
            self._call("export", request_id, block_ids, bytes_per_block)
        )

    def release(self, request_id: str) -> bool:
        return self._call("release", request_id)

    def pulled(self) -> list[str]:
        return self._call("pulled")

    def usage(self) -> TransportUsage:
        return self._call("usage")

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self._process.join(timeout=10)

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._call("close")
            except (EOFError, OSError, TimeoutError):
                logger.exception("producer did not close cleanly")
            self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=10)
        self._conn.close()

    def _call(self, command: str, *args):
        self._conn.send((command, args))
        if not self._conn.poll(REPLY_TIMEOUT_S):
            raise TimeoutError(f"producer did not answer {command!r} in {REPLY_TIMEOUT_S} s")
        status, value = self._conn.recv()
        if status == "error":
            error_type, message = value
            error_class = getattr(errors, error_type, Dsv4Error)
            raise error_class(message)
        return value


def _child_main(kind: str, geometry: Geometry, device: str, conn) -> None:
    logging.basicConfig(level=logging.INFO)
    transport = make_transport(kind)
    transport.register(make_pattern(geometry, device))
    pulled: list[str] = []
    while True:
        if conn.poll(0.001):
            command, args = conn.recv()
            try:
                value = _run_command(transport, command, args, pulled)
            except Dsv4Error as exc:
                conn.send(("error", (type(exc).__name__, exc.message)))
                continue
            conn.send(("ok", value))
            if command == "close":
                return
        pulled.extend(transport.progress())


def _run_command(transport, command: str, args: tuple, pulled: list[str]):
    if command == "endpoint":
        return transport.endpoint().to_bytes()
    if command == "export":
        return transport.export(*args).to_bytes()
    if command == "release":
        return transport.release(*args)
    if command == "pulled":
        pulled.extend(transport.progress())
        drained = list(pulled)
        pulled.clear()
        return drained
    if command == "usage":
        return transport.usage()
    if command == "close":
        transport.close()
        return transport.usage()
    raise ValueError(f"unknown command {command!r}")
