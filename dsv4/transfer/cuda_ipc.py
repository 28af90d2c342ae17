"""Same-host GPU transport through CUDA IPC handles (NIXL's VRAM path reached only ~0.5 GB/s
between two processes on one H200: docs/architecture.md#platform-notes).

P shares its backing tensor and its lease-token table as CUDA IPC handles (torch's own
`reduce_tensor` / `rebuild_cuda_tensor`, serialised as JSON in the endpoint payload). D opens them
once per peer and copies the listed blocks with index_select / index_copy_ on its own stream, then
copies P's lease slot to pinned host memory and records an event; `poll` checks the event and the
token. P and D must be different processes on one host (CUDA cannot open its own IPC handle:
use `local` inside one process). On a machine without CUDA, `is_available()` is False.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass

import torch

from dsv4.errors import NotFound, TransferError
from dsv4.transfer.base import (
    ExportedBlocks,
    ExportingTransport,
    ExportTable,
    PullHandle,
    PullState,
    PullStatus,
    TransferStats,
    TransportEndpoint,
    TransportUsage,
    check_backing,
    check_pull_args,
    copy_blocks,
)

logger = logging.getLogger(__name__)


def is_available() -> bool:
    return torch.cuda.is_available()


@dataclass
class _Peer:
    pid: int
    backing: torch.Tensor  # P's backing, opened from its IPC handle
    tokens: torch.Tensor  # P's lease-token table
    num_active_pulls: int = 0


@dataclass
class _Pull:
    handle: PullHandle
    peer: _Peer
    exported: ExportedBlocks
    done_event: torch.cuda.Event
    landed_token: torch.Tensor  # pinned [1] int64
    started_s: float
    deadline_s: float


class CudaIpcTransport(ExportingTransport):
    kind = "cuda_ipc"

    def __init__(self, *, max_exports: int = 4096, pull_timeout_s: float = 10.0) -> None:
        self.peer_id = f"cuda_ipc-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._max_exports = max_exports
        self._pull_timeout_s = pull_timeout_s
        self._lock = threading.RLock()
        self._backing: torch.Tensor | None = None
        self._exports: ExportTable | None = None
        self._stream: torch.cuda.Stream | None = None
        self._peers: dict[str, _Peer] = {}
        self._pulls: dict[int, _Pull] = {}
        self._pulled: list[str] = []
        self._pull_ids = itertools.count(1)

    def register(self, backing: torch.Tensor) -> None:
        check_backing(backing)
        if not is_available() or not backing.is_cuda:
            raise TransferError("cuda_ipc needs a CUDA backing tensor; use nixl or local instead")
        with self._lock:
            if self._backing is not None:
                raise TransferError(f"{self.peer_id}: register() called twice")
            self._backing = backing
            self._exports = ExportTable.beside(backing, self._max_exports)
            self._stream = torch.cuda.Stream(device=backing.device)

    def endpoint(self) -> TransportEndpoint:
        backing = self._require_backing()
        assert self._exports is not None
        payload = {
            "pid": os.getpid(),
            "backing": _share(backing),
            "tokens": _share(self._exports.tokens),
        }
        num_blocks, stride = backing.shape
        return TransportEndpoint(
            self.kind, self.peer_id, num_blocks, stride, json.dumps(payload).encode()
        )

    def progress(self) -> list[str]:
        """P side. CUDA IPC has no notification channel: P learns of pulls through the service's
        Release call, so this returns nothing."""
        return []

    def start_pull(
        self,
        src: TransportEndpoint,
        exported: ExportedBlocks,
        dst_block_ids: list[int],
        timeout_s: float | None = None,
    ) -> PullHandle:
        backing = self._require_backing()
        num_blocks, stride = backing.shape
        dst_ids = check_pull_args(src, exported, dst_block_ids, self.kind, num_blocks, stride)
        handle = PullHandle(
            next(self._pull_ids), exported.request_id, src.peer_id, exported.num_bytes
        )
        with self._lock:
            peer = self._open_peer(src)
            assert self._stream is not None
            started = time.monotonic()
            nbytes = exported.bytes_per_block
            landed_token = torch.zeros(1, dtype=torch.int64, pin_memory=True)
            done_event = torch.cuda.Event()
            self._stream.wait_stream(torch.cuda.current_stream(backing.device))
            with torch.cuda.stream(self._stream):
                copy_blocks(peer.backing, exported.block_ids, backing, dst_ids, nbytes)
                slot = exported.lease_slot
                landed_token.copy_(peer.tokens[slot : slot + 1], non_blocking=True)
                done_event.record(self._stream)
            timeout = self._pull_timeout_s if timeout_s is None else timeout_s
            pull = _Pull(
                handle, peer, exported, done_event, landed_token, started, started + timeout
            )
            peer.num_active_pulls += 1
            self._pulls[handle.pull_id] = pull
        return handle

    def poll(self, handle: PullHandle) -> PullState:
        with self._lock:
            pull = self._pulls.get(handle.pull_id)
            if pull is None:
                raise NotFound(
                    f"pull {handle.pull_id} of {handle.request_id!r} is unknown or was polled"
                )
            if not pull.done_event.query():
                if time.monotonic() < pull.deadline_s:
                    return PullState(PullStatus.PENDING)
                pull.done_event.synchronize()  # NOTE: a local GPU copy cannot hang for long
            self._pulls.pop(handle.pull_id)
            pull.peer.num_active_pulls -= 1
            if not _is_process_alive(pull.peer.pid):
                self._drop_peer(handle.peer_id)
                return PullState(
                    PullStatus.FAILED, f"peer {handle.peer_id} (pid {pull.peer.pid}) is gone"
                )
            if int(pull.landed_token[0]) != pull.exported.lease_token:
                message = f"export of {handle.request_id!r} on {handle.peer_id} was released or is unknown"
                return PullState(PullStatus.FAILED, message)
            stats = TransferStats(pull.exported.num_bytes, time.monotonic() - pull.started_s)
            return PullState(PullStatus.DONE, stats=stats)

    def usage(self) -> TransportUsage:
        with self._lock:
            return TransportUsage(self._num_exports(), len(self._pulls), len(self._peers))

    def close(self) -> None:
        with self._lock:
            if self._stream is not None:
                self._stream.synchronize()  # in-flight copies finish before memory goes
            self._pulls.clear()
            self._peers.clear()
            self._drop_exports()
            self._backing = None
            self._stream = None

    def _open_peer(self, src: TransportEndpoint) -> _Peer:
        peer = self._peers.get(src.peer_id)
        if peer is not None:
            return peer
        payload = json.loads(src.payload)
        if payload["pid"] == os.getpid():
            raise TransferError(
                "cuda_ipc cannot pull from its own process; use the local transport"
            )
        if not _is_process_alive(payload["pid"]):
            raise TransferError(f"peer {src.peer_id} (pid {payload['pid']}) is gone")
        try:
            peer = _Peer(payload["pid"], _open(payload["backing"]), _open(payload["tokens"]))
        except RuntimeError as exc:
            raise TransferError(f"cannot open CUDA IPC handles of {src.peer_id}: {exc}") from exc
        self._peers[src.peer_id] = peer
        return peer

    def _drop_peer(self, peer_id: str) -> None:
        peer = self._peers.get(peer_id)
        if peer is not None and peer.num_active_pulls == 0:
            del self._peers[peer_id]

    def _require_backing(self) -> torch.Tensor:
        if self._backing is None:
            raise TransferError(f"{self.peer_id}: call register() first (or it was closed)")
        return self._backing


def _share(tensor: torch.Tensor) -> dict:
    """The CUDA IPC description of a tensor as JSON-able values (torch's own reduction)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)
    (_, size, stride, offset, _, dtype, device, handle, storage_bytes, storage_offset_bytes, _,
     ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = args  # fmt: skip
    return {
        "size": list(size),
        "stride": list(stride),
        "offset": offset,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "handle": _b64(handle),
        "storage_bytes": storage_bytes,
        "storage_offset_bytes": storage_offset_bytes,
        "ref_counter_handle": _b64(ref_counter_handle),
        "ref_counter_offset": ref_counter_offset,
        "event_handle": _b64(event_handle),
        "event_sync_required": event_sync_required,
    }


def _open(shared: dict) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(shared["size"]),
        tuple(shared["stride"]),
        shared["offset"],
        torch.UntypedStorage,
        getattr(torch, shared["dtype"]),
        shared["device"],
        base64.b64decode(shared["handle"]),
        shared["storage_bytes"],
        shared["storage_offset_bytes"],
        False,
        base64.b64decode(shared["ref_counter_handle"]),
        shared["ref_counter_offset"],
        base64.b64decode(shared["event_handle"]) if shared["event_handle"] else None,
        shared["event_sync_required"],
    )


def _b64(value: bytes | None) -> str:
    return base64.b64encode(value).decode() if value else ""


def _is_process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
