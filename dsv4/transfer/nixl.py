"""NIXL (UCX) transport: one agent per worker, D READs P's blocks; CPU (DRAM) in CI, VRAM on GPU.

- The agent runs without a progress thread (docs/architecture.md#platform-notes: 3x faster on few
  cores), so both sides drive it: D from `poll`, P from `progress()`, which the P service calls
  every few ms.
- `register` registers the backing tensor (D's READ destination) and a small DRAM control
  tensor once. `export` registers just the lease's blocks and puts partial agent metadata for
  them in `ExportedBlocks.grant`; `release` deregisters them (nixl_agent.py: what a grant
  restricts, and what it cannot).
- `TransportEndpoint.payload` carries P's public agent metadata (connection info and the
  lease slots, no key to any block) and region addresses (JSON), so D builds P's descriptor
  lists itself: no pickled descriptors cross the wire. A pull loads the export's grant, preps
  the lease's blocks and is one `make_prepped_xfer`.
- A pull is two READs: the blocks, then P's 8-byte lease slot (the lease check in base.py), which
  carries the notification `dsv4.pulled|slot|token|request_id` to P.
- A peer that fails (ERR or timeout) is dropped with all its pulls; a restarted P has a new
  agent name (`peer_id`), so D never reuses a stale connection.
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import torch

from dsv4.errors import NotFound, ResourceExhausted, TransferError
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
)
from dsv4.transfer.nixl_agent import NixlAgentBox, Peer

logger = logging.getLogger(__name__)

NOTICE_PREFIX = b"dsv4.pulled|"


@dataclass
class _Pull:
    handle: PullHandle
    peer: Peer
    exported: ExportedBlocks
    landing_slot: int
    data_xfer: object
    data_dlist: object  # the lease's blocks on P, prepped for this pull
    check_xfer: object
    started_s: float
    deadline_s: float
    phase: str = "data"  # "data" -> "check"
    post_error: str | None = None


class NixlTransport(ExportingTransport):
    kind = "nixl"

    def __init__(
        self,
        *,
        max_exports: int = 4096,
        max_pending_pulls: int = 1024,
        pull_timeout_s: float = 10.0,
        ucx_backend_params: dict[str, str] | None = None,
        net_devices: str = "",
    ) -> None:
        self.peer_id = f"nixl-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._net_devices = net_devices  # UCX_NET_DEVICES while UCX starts; "": UCX's default
        self._max_exports = max_exports
        self._max_pending_pulls = max_pending_pulls
        self._pull_timeout_s = pull_timeout_s
        self._ucx_backend_params = ucx_backend_params or {}
        self._lock = threading.RLock()
        self._box: NixlAgentBox | None = None
        self._backing: torch.Tensor | None = None
        self._control: torch.Tensor | None = None  # [2, max_slots] int64: exports, pull landing
        self._exports: ExportTable | None = None
        self._free_landing = list(range(max_pending_pulls - 1, -1, -1))
        self._peers: dict[str, Peer] = {}
        self._retiring: dict[str, Peer] = {}
        self._pulls: dict[int, _Pull] = {}
        self._pull_ids = itertools.count(1)

    # ---- setup -------------------------------------------------------------------------------

    def register(self, backing: torch.Tensor) -> None:
        check_backing(backing)
        with self._lock:
            if self._box is not None:
                raise TransferError(f"{self.peer_id}: register() called twice")
            num_slots = max(self._max_exports, self._max_pending_pulls)
            self._control = torch.zeros(2, num_slots, dtype=torch.int64)
            self._box = NixlAgentBox(
                self.peer_id, backing, self._control, self._ucx_backend_params, self._net_devices
            )
            self._backing = backing
            self._exports = ExportTable(self._control[0, : self._max_exports], *backing.shape)

    def endpoint(self) -> TransportEndpoint:
        box = self._require_box()
        metadata = base64.b64encode(box.public_metadata()).decode()
        region = {**box.region, "metadata": metadata}
        num_blocks, stride = box.backing_shape
        return TransportEndpoint(
            self.kind, self.peer_id, num_blocks, stride, json.dumps(region).encode()
        )

    # ---- P side ------------------------------------------------------------------------------

    # `export` / `release`: `ExportingTransport`; a lease's blocks are granted to remote READs.

    def _grant(self, exported: ExportedBlocks) -> ExportedBlocks:
        request_id = exported.request_id
        try:
            grant = self._require_box().grant(
                request_id, exported.block_ids, exported.bytes_per_block
            )
        except Exception as exc:
            raise TransferError(f"cannot register the blocks of {request_id!r}: {exc}") from exc
        return dataclasses.replace(exported, grant=grant)

    def _revoke(self, request_id: str) -> None:
        self._require_box().revoke(request_id)

    def progress(self) -> list[str]:
        with self._lock:
            if self._box is None or self._exports is None:
                return []
            pulled = []
            for sender, messages in self._box.agent.get_new_notifs().items():
                for message in messages:
                    request_id = self._parse_notice(message)
                    if request_id is None:
                        logger.warning("ignoring notice %r from %s", message[:80], sender)
                    elif request_id:
                        pulled.append(request_id)
            return pulled

    def _parse_notice(self, message: bytes) -> str | None:
        """Request id of a valid notice, "" for a stale one (export already released)."""
        if not message.startswith(NOTICE_PREFIX):
            return None
        try:
            slot, token, request_id = message[len(NOTICE_PREFIX) :].decode().split("|", 2)
            live_request = self._exports.request_for(int(slot), int(token))  # type: ignore[union-attr]
        except ValueError:
            return None
        return request_id if live_request == request_id else ""

    # ---- D side ------------------------------------------------------------------------------

    def start_pull(
        self,
        src: TransportEndpoint,
        exported: ExportedBlocks,
        dst_block_ids: list[int],
        timeout_s: float | None = None,
    ) -> PullHandle:
        box = self._require_box()
        num_blocks, stride = box.backing_shape
        dst_ids = check_pull_args(src, exported, dst_block_ids, self.kind, num_blocks, stride)
        handle = PullHandle(
            next(self._pull_ids), exported.request_id, src.peer_id, exported.num_bytes
        )
        with self._lock:
            if not self._free_landing:
                raise ResourceExhausted(
                    f"{self._max_pending_pulls} pulls already pending; poll them first",
                    retry_after_s=0.01,
                )
            peer = self._connect(src)
            if not exported.grant:
                raise TransferError(f"export of {exported.request_id!r} carries no grant")
            try:
                box.load_metadata(exported.grant, peer.name)
                data_xfer, data_dlist = box.make_data_read(
                    peer, exported.bytes_per_block, dst_ids, exported.block_ids
                )
            except Exception as exc:  # not granted to us, or a bad grant: the peer is fine
                raise TransferError(
                    f"pull of {exported.request_id!r}: the blocks are not granted ({exc})"
                ) from exc
            landing_slot = self._free_landing.pop()
            self._control[1, landing_slot] = 0  # type: ignore[index]
            notice = NOTICE_PREFIX + f"{exported.lease_slot}|{exported.lease_token}|".encode()
            try:
                check_xfer = box.make_check_read(
                    peer, landing_slot, exported.lease_slot, notice + exported.request_id.encode()
                )
            except Exception as exc:
                self._free_landing.append(landing_slot)
                box.release_xfer(data_xfer)
                box.release_dlist(data_dlist)
                self._drop_peer(peer, f"cannot prepare a READ from {peer.name}: {exc}")
                raise TransferError(f"pull of {exported.request_id!r}: {exc}") from exc
            now = time.monotonic()
            timeout = self._pull_timeout_s if timeout_s is None else timeout_s
            pull = _Pull(handle, peer, exported, landing_slot, data_xfer, data_dlist, check_xfer,
                         now, now + timeout)  # fmt: skip
            peer.num_active_pulls += 1
            self._pulls[handle.pull_id] = pull
            if box.post(data_xfer) == "ERR":
                pull.post_error = f"posting the READ from {peer.name} failed"
        return handle

    def poll(self, handle: PullHandle) -> PullState:
        with self._lock:
            pull = self._pulls.get(handle.pull_id)
            if pull is None:
                raise NotFound(
                    f"pull {handle.pull_id} of {handle.request_id!r} is unknown or was polled"
                )
            return self._advance(pull)

    def _advance(self, pull: _Pull) -> PullState:
        box, name = self._require_box(), pull.peer.name
        if pull.peer.failure is not None:
            return self._fail(pull, pull.peer.failure, peer_failed=False)
        xfer_state = box.state(pull.data_xfer if pull.phase == "data" else pull.check_xfer)
        if pull.post_error or xfer_state == "ERR":
            reason = pull.post_error or f"READ from {name} failed (peer gone?)"
            return self._fail(pull, reason, peer_failed=True)
        if xfer_state == "PROC":
            if time.monotonic() <= pull.deadline_s:
                return PullState(PullStatus.PENDING)
            timeout_s = pull.deadline_s - pull.started_s
            return self._fail(
                pull, f"READ from {name} timed out after {timeout_s:.1f} s", peer_failed=True
            )
        if pull.phase == "data":
            pull.phase = "check"
            pull.post_error = (
                None
                if box.post(pull.check_xfer) != "ERR"
                else f"lease check READ from {name} failed"
            )
            return PullState(PullStatus.PENDING)
        if int(self._control[1, pull.landing_slot]) != pull.exported.lease_token:  # type: ignore[index]
            reason = f"export of {pull.exported.request_id!r} on {name} was released or is unknown"
            return self._fail(pull, reason, peer_failed=False)
        self._finish(pull)
        stats = TransferStats(pull.exported.num_bytes, time.monotonic() - pull.started_s)
        return PullState(PullStatus.DONE, stats=stats)

    def _fail(self, pull: _Pull, message: str, *, peer_failed: bool) -> PullState:
        logger.warning(
            "pull %d of %r failed: %s", pull.handle.pull_id, pull.handle.request_id, message
        )
        if peer_failed:
            self._drop_peer(pull.peer, message)
        self._finish(pull)
        return PullState(PullStatus.FAILED, message)

    def _finish(self, pull: _Pull) -> None:
        self._pulls.pop(pull.handle.pull_id, None)
        self._free_landing.append(pull.landing_slot)
        box = self._require_box()
        box.release_xfer(pull.data_xfer)
        box.release_xfer(pull.check_xfer)
        box.release_dlist(pull.data_dlist)
        pull.peer.num_active_pulls -= 1
        self._retire_if_idle(pull.peer)

    # ---- peers -------------------------------------------------------------------------------

    def _connect(self, src: TransportEndpoint) -> Peer:
        peer = self._peers.get(src.peer_id)
        if peer is not None:
            return peer
        if src.peer_id in self._retiring:
            raise TransferError(
                f"peer {src.peer_id} failed recently and is being disconnected; retry"
            )
        try:
            region = json.loads(src.payload)
            metadata = base64.b64decode(region.pop("metadata"))
            region["num_blocks"] = src.num_blocks
            peer = Peer(self._require_box().load_metadata(metadata, src.peer_id), region)
        except Exception as exc:
            raise TransferError(f"cannot load NIXL metadata of {src.peer_id}: {exc}") from exc
        self._peers[src.peer_id] = peer
        return peer

    def _drop_peer(self, peer: Peer, reason: str) -> None:
        """Fail every pull of the peer (at their next poll) and disconnect once none is in flight."""
        if self._peers.get(peer.name) is peer:
            logger.warning("dropping NIXL peer %s: %s", peer.name, reason)
            del self._peers[peer.name]
            peer.failure = f"peer {peer.name} failed: {reason}"
            self._retiring[peer.name] = peer
        self._retire_if_idle(peer)

    def _retire_if_idle(self, peer: Peer) -> None:
        if peer.num_active_pulls == 0 and self._retiring.get(peer.name) is peer:
            del self._retiring[peer.name]
            self._require_box().remove_peer(peer)

    # ---- lifecycle ---------------------------------------------------------------------------

    def usage(self) -> TransportUsage:
        with self._lock:
            box = self._box
            return TransportUsage(
                num_exports=self._num_exports(),
                num_pending_pulls=len(self._pulls),
                num_peers=len(self._peers) + len(self._retiring),
                num_abandoned_xfers=box.num_abandoned_xfers if box is not None else 0,
                num_grants=box.num_grants if box is not None else 0,
            )

    def close(self) -> None:
        with self._lock:
            if self._box is None:
                return
            for pull in list(self._pulls.values()):
                self._fail(pull, "transport closed", peer_failed=False)
            for peer in list(self._peers.values()):
                self._drop_peer(peer, "transport closed")
            self._drop_exports()
            self._box.close()
            self._box = None
            self._backing = None
            self._control = None

    def _require_box(self) -> NixlAgentBox:
        box = self._box
        if box is None:
            raise TransferError(f"{self.peer_id}: call register() first (or it was closed)")
        return box
