"""KV block transport between prefill (P) and decode (D) workers.

Reading path: `base.py` (the `KVTransport` contract, the wire dataclasses, the lease check),
`local.py` (in-process copies), `nixl.py` (NIXL/UCX READ, between hosts and on CPU in CI),
`cuda_ipc.py` (same-host GPU). `make_transport(kind)` imports only the implementation asked for.
"""

from __future__ import annotations

from typing import Any

from dsv4.errors import ConfigError
from dsv4.transfer.base import (
    ExportedBlocks,
    KVTransport,
    PullHandle,
    PullState,
    PullStatus,
    TransferStats,
    TransportEndpoint,
    TransportUsage,
    wait_pull,
)

TRANSPORT_KINDS = ("local", "nixl", "cuda_ipc")


def make_transport(kind: str, **options: Any) -> KVTransport:
    """Build the transport named `kind` ("local" | "nixl" | "cuda_ipc") with its options."""
    if kind == "local":
        from dsv4.transfer.local import LocalTransport

        return LocalTransport(**options)
    if kind == "nixl":
        from dsv4.transfer.nixl import NixlTransport

        return NixlTransport(**options)
    if kind == "cuda_ipc":
        from dsv4.transfer.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport(**options)
    raise ConfigError("transport", kind, f"choose one of {', '.join(TRANSPORT_KINDS)}")


__all__ = [
    "TRANSPORT_KINDS",
    "ExportedBlocks",
    "KVTransport",
    "PullHandle",
    "PullState",
    "PullStatus",
    "TransferStats",
    "TransportEndpoint",
    "TransportUsage",
    "make_transport",
    "wait_pull",
]
