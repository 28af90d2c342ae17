"""In-process transport: P and D live in one process (a colocated worker, tests); real copies.

Peers find each other through a process-wide table keyed by `peer_id`. A pull copies at once on
the caller's thread (torch index_select/index_copy_), so `poll` only reports the result.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
import weakref

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

_PEERS: weakref.WeakValueDictionary[str, LocalTransport] = weakref.WeakValueDictionary()
_PEERS_LOCK = threading.Lock()


class LocalTransport(ExportingTransport):
    kind = "local"

    def __init__(self, *, max_exports: int = 4096, pull_timeout_s: float = 10.0) -> None:
        """`pull_timeout_s` is accepted for a uniform API; local copies finish inside start_pull."""
        self.peer_id = f"local-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._max_exports = max_exports
        self._lock = threading.RLock()
        self._backing: torch.Tensor | None = None
        self._exports: ExportTable | None = None
        self._pulled: list[str] = []
        self._finished: dict[int, PullState] = {}
        self._pull_ids = itertools.count(1)

    def register(self, backing: torch.Tensor) -> None:
        check_backing(backing)
        with self._lock:
            if self._backing is not None:
                raise TransferError(f"{self.peer_id}: register() called twice")
            self._backing = backing
            self._exports = ExportTable.beside(backing, self._max_exports)
        with _PEERS_LOCK:
            _PEERS[self.peer_id] = self

    def endpoint(self) -> TransportEndpoint:
        backing = self._require_backing()
        return TransportEndpoint(self.kind, self.peer_id, backing.shape[0], backing.shape[1])

    def progress(self) -> list[str]:
        with self._lock:
            pulled, self._pulled = self._pulled, []
            return pulled

    def start_pull(
        self,
        src: TransportEndpoint,
        exported: ExportedBlocks,
        dst_block_ids: list[int],
        timeout_s: float | None = None,
    ) -> PullHandle:
        backing = self._require_backing()
        dst_ids = check_pull_args(
            src, exported, dst_block_ids, self.kind, backing.shape[0], backing.shape[1]
        )
        handle = PullHandle(
            next(self._pull_ids), exported.request_id, src.peer_id, exported.num_bytes
        )
        state = self._copy_from_peer(src.peer_id, exported, dst_ids)
        with self._lock:
            self._finished[handle.pull_id] = state
        return handle

    def poll(self, handle: PullHandle) -> PullState:
        with self._lock:
            state = self._finished.pop(handle.pull_id, None)
        if state is None:
            raise NotFound(
                f"pull {handle.pull_id} of {handle.request_id!r} is unknown or was polled"
            )
        return state

    def usage(self) -> TransportUsage:
        with self._lock:
            return TransportUsage(self._num_exports(), len(self._finished), 0)

    def close(self) -> None:
        with _PEERS_LOCK:
            _PEERS.pop(self.peer_id, None)
        with self._lock:
            self._drop_exports()
            self._backing = None
            self._finished.clear()
            self._pulled.clear()

    def _copy_from_peer(
        self, peer_id: str, exported: ExportedBlocks, dst_ids: tuple[int, ...]
    ) -> PullState:
        with _PEERS_LOCK:
            peer = _PEERS.get(peer_id)
        if peer is None:
            return PullState(PullStatus.FAILED, f"peer {peer_id} is gone (closed or never existed)")
        started = time.perf_counter()
        # NOTE: hold P's lock for the copy + token check so a concurrent release cannot interleave.
        with peer._lock:
            if peer._backing is None or peer._exports is None:
                return PullState(PullStatus.FAILED, f"peer {peer_id} is closed")
            if not peer._exports.is_live(exported.lease_slot, exported.lease_token):
                return PullState(
                    PullStatus.FAILED,
                    f"export of {exported.request_id!r} on {peer_id} was released or is unknown",
                )
            copy_blocks(
                peer._backing,
                exported.block_ids,
                self._require_backing(),
                dst_ids,
                exported.bytes_per_block,
            )
            peer._pulled.append(exported.request_id)
        stats = TransferStats(exported.num_bytes, time.perf_counter() - started)
        return PullState(PullStatus.DONE, stats=stats)

    def _require_backing(self) -> torch.Tensor:
        if self._backing is None:
            raise TransferError(f"{self.peer_id}: call register() first (or it was closed)")
        return self._backing
