"""NIXL (UCX) transport: one agent per worker, D READs P's blocks; CPU (DRAM) in CI, VRAM on GPU.

- The agent runs without a progress thread (PLATFORM_NOTES §3: 3x faster on few cores), so both
  sides drive it: D from `poll`, P from `progress()`, which the P service calls every few ms.
- `register` registers the backing tensor and a small DRAM control tensor once. Per-block
  descriptor lists are prepped once per (peer, bytes_per_block); a pull is `make_prepped_xfer`
  with index lists = block ids.
- `TransportEndpoint.payload` carries P's agent metadata and region addresses (JSON), so D builds
  P's descriptor lists itself: no pickled descriptors cross the wire.
- A pull is two READs: the blocks, then P's 8-byte lease slot (the lease check in base.py), which
  carries the notification `dsv4.pulled|slot|token|request_id` to P.
- A peer that fails (ERR or timeout) is dropped with all its pulls; a restarted P has a new
  agent name (`peer_id`), so D never reuses a stale connection.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from dsv4.errors import NotFound, ResourceExhausted, TransferError
from dsv4.transfer.base import (
    ExportedBlocks,
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

logger = logging.getLogger(__name__)

NOTICE_PREFIX = b"dsv4.pulled|"
UCX_NET_DEVICES_ENV = "UCX_NET_DEVICES"


@dataclass
class _Peer:
    name: str
    region: dict
    data_dlists: dict[int, object] = field(default_factory=dict)  # bytes_per_block -> handle
    control_dlist: object | None = None
    num_active_pulls: int = 0
    failure: str | None = None


@dataclass
class _Pull:
    handle: PullHandle
    peer: _Peer
    exported: ExportedBlocks
    landing_slot: int
    data_xfer: object
    check_xfer: object
    started_s: float
    deadline_s: float
    phase: str = "data"  # "data" -> "check"
    post_error: str | None = None


class NixlAgentBox:
    """The NIXL agent and everything registered or prepped on it; callers hold the lock."""

    def __init__(
        self,
        name: str,
        backing: torch.Tensor,
        control: torch.Tensor,
        ucx_params: dict[str, str],
        net_devices: str = "",
    ) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise TransferError(f"NIXL is not installed ({exc}); pip install nixl") from exc
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        with ucx_environment(net_devices):
            self.agent.create_backend("UCX", ucx_params)
        self.backing_shape: tuple[int, int] = (backing.shape[0], backing.shape[1])
        self.region = {  # what D needs to address our memory; travels in the endpoint payload
            "data_addr": backing.data_ptr(),
            "data_mem": "VRAM" if backing.is_cuda else "DRAM",
            "device_id": (backing.device.index or 0) if backing.is_cuda else 0,
            "control_addr": control.data_ptr(),
            "num_slots": control.shape[1],
        }
        self._regs = [self.agent.register_memory(backing), self.agent.register_memory(control)]
        self._local_data_dlists: dict[int, object] = {}
        num_slots = control.shape[1]
        landing = _strided_descs(control.data_ptr() + 8 * num_slots, 8, 8, num_slots, 0)
        self._local_landing = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", landing, "DRAM")
        self._abandoned_xfers: list[object] = []

    @property
    def num_abandoned_xfers(self) -> int:
        return len(self._abandoned_xfers)

    def add_peer(self, metadata: bytes, expected_name: str) -> str:
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        if name != expected_name:
            self.agent.remove_remote_agent(name)
            raise TransferError(f"metadata names agent {name!r}, endpoint says {expected_name!r}")
        return name

    def remove_peer(self, peer: _Peer) -> None:
        for dlist in [*peer.data_dlists.values(), peer.control_dlist]:
            if dlist is not None:
                self.agent.release_dlist_handle(dlist)
        peer.data_dlists.clear()
        peer.control_dlist = None
        try:
            self.agent.remove_remote_agent(peer.name)
        except Exception:
            logger.exception("removing NIXL peer %s failed", peer.name)

    def make_data_read(
        self, peer: _Peer, nbytes: int, dst_ids: tuple[int, ...], src_ids: tuple[int, ...]
    ) -> object:
        stride = self.backing_shape[1]  # P and D strides are equal (checked before any pull)
        local = self._local_data_dlists.get(nbytes)
        if local is None:
            mine = self.region
            descs = _strided_descs(
                mine["data_addr"], stride, nbytes, self.backing_shape[0], mine["device_id"]
            )
            local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, mine["data_mem"])
            self._local_data_dlists[nbytes] = local
        remote = peer.data_dlists.get(nbytes)
        if remote is None:
            theirs = peer.region
            descs = _strided_descs(
                theirs["data_addr"], stride, nbytes, theirs["num_blocks"], theirs["device_id"]
            )
            remote = self.agent.prep_xfer_dlist(peer.name, descs, theirs["data_mem"])
            peer.data_dlists[nbytes] = remote
        return self.agent.make_prepped_xfer(
            "READ", local, np.asarray(dst_ids, np.int32), remote, np.asarray(src_ids, np.int32)
        )

    def make_check_read(
        self, peer: _Peer, landing_slot: int, lease_slot: int, notice: bytes
    ) -> object:
        if peer.control_dlist is None:
            descs = _strided_descs(peer.region["control_addr"], 8, 8, peer.region["num_slots"], 0)
            peer.control_dlist = self.agent.prep_xfer_dlist(peer.name, descs, "DRAM")
        return self.agent.make_prepped_xfer(
            "READ", self._local_landing, [landing_slot], peer.control_dlist, [lease_slot], notice
        )

    def post(self, xfer: object) -> str:
        """Post a prepared transfer: "DONE" | "PROC" | "ERR" (NIXL errors are logged, not raised)."""
        try:
            return self.agent.transfer(xfer)
        except Exception as exc:
            logger.warning("NIXL post failed: %s: %s", type(exc).__name__, exc)
            return "ERR"

    def state(self, xfer: object) -> str:
        try:
            return self.agent.check_xfer_state(xfer)
        except Exception as exc:
            logger.warning("NIXL transfer failed: %s: %s", type(exc).__name__, exc)
            return "ERR"

    def release_xfer(self, xfer: object) -> None:
        """Release (cancelling if in flight); one NIXL cannot cancel is kept and retried."""
        for pending in [*self._abandoned_xfers, xfer]:
            try:
                self.agent.release_xfer_handle(pending)
            except Exception as exc:
                if pending is xfer:
                    logger.warning(
                        "NIXL could not release a transfer yet (%s); retrying later", exc
                    )
                    self._abandoned_xfers.append(xfer)
            else:
                if pending is not xfer:
                    self._abandoned_xfers.remove(pending)

    def close(self) -> None:
        for dlist in [*self._local_data_dlists.values(), self._local_landing]:
            self.agent.release_dlist_handle(dlist)
        self._local_data_dlists.clear()
        for xfer in list(self._abandoned_xfers):
            self.release_xfer(xfer)
        if self._abandoned_xfers:
            logger.error("closing NIXL with %d uncancellable transfers", len(self._abandoned_xfers))
        for reg in self._regs:
            self.agent.deregister_memory(reg)
        self._regs.clear()
        del self.agent


class NixlTransport:
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
        self._peers: dict[str, _Peer] = {}
        self._retiring: dict[str, _Peer] = {}
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
        metadata = base64.b64encode(box.agent.get_agent_metadata()).decode()
        region = {**box.region, "metadata": metadata}
        num_blocks, stride = box.backing_shape
        return TransportEndpoint(
            self.kind, self.peer_id, num_blocks, stride, json.dumps(region).encode()
        )

    # ---- P side ------------------------------------------------------------------------------

    def export(
        self, request_id: str, block_ids: list[int], bytes_per_block: int | None = None
    ) -> ExportedBlocks:
        self._require_box()
        with self._lock:
            assert self._exports is not None
            return self._exports.add(self.peer_id, request_id, block_ids, bytes_per_block)

    def release(self, request_id: str) -> bool:
        with self._lock:
            return self._exports is not None and self._exports.remove(request_id)

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
            landing_slot = self._free_landing.pop()
            self._control[1, landing_slot] = 0  # type: ignore[index]
            notice = NOTICE_PREFIX + f"{exported.lease_slot}|{exported.lease_token}|".encode()
            try:
                data_xfer = box.make_data_read(
                    peer, exported.bytes_per_block, dst_ids, exported.block_ids
                )
                check_xfer = box.make_check_read(
                    peer, landing_slot, exported.lease_slot, notice + exported.request_id.encode()
                )
            except Exception as exc:
                self._free_landing.append(landing_slot)
                self._drop_peer(peer, f"cannot prepare a READ from {peer.name}: {exc}")
                raise TransferError(f"pull of {exported.request_id!r}: {exc}") from exc
            now = time.monotonic()
            timeout = self._pull_timeout_s if timeout_s is None else timeout_s
            pull = _Pull(
                handle, peer, exported, landing_slot, data_xfer, check_xfer, now, now + timeout
            )
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
        pull.peer.num_active_pulls -= 1
        self._retire_if_idle(pull.peer)

    # ---- peers -------------------------------------------------------------------------------

    def _connect(self, src: TransportEndpoint) -> _Peer:
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
            peer = _Peer(self._require_box().add_peer(metadata, src.peer_id), region)
        except Exception as exc:
            raise TransferError(f"cannot load NIXL metadata of {src.peer_id}: {exc}") from exc
        self._peers[src.peer_id] = peer
        return peer

    def _drop_peer(self, peer: _Peer, reason: str) -> None:
        """Fail every pull of the peer (at their next poll) and disconnect once none is in flight."""
        if self._peers.get(peer.name) is peer:
            logger.warning("dropping NIXL peer %s: %s", peer.name, reason)
            del self._peers[peer.name]
            peer.failure = f"peer {peer.name} failed: {reason}"
            self._retiring[peer.name] = peer
        self._retire_if_idle(peer)

    def _retire_if_idle(self, peer: _Peer) -> None:
        if peer.num_active_pulls == 0 and self._retiring.get(peer.name) is peer:
            del self._retiring[peer.name]
            self._require_box().remove_peer(peer)

    # ---- lifecycle ---------------------------------------------------------------------------

    def usage(self) -> TransportUsage:
        with self._lock:
            box = self._box
            return TransportUsage(
                num_exports=len(self._exports) if self._exports is not None else 0,
                num_pending_pulls=len(self._pulls),
                num_peers=len(self._peers) + len(self._retiring),
                num_abandoned_xfers=box.num_abandoned_xfers if box is not None else 0,
            )

    def close(self) -> None:
        with self._lock:
            if self._box is None:
                return
            for pull in list(self._pulls.values()):
                self._fail(pull, "transport closed", peer_failed=False)
            for peer in list(self._peers.values()):
                self._drop_peer(peer, "transport closed")
            assert self._exports is not None
            self._exports.clear()
            self._box.close()
            self._box = None
            self._exports = None
            self._backing = None
            self._control = None

    def _require_box(self) -> NixlAgentBox:
        box = self._box
        if box is None:
            raise TransferError(f"{self.peer_id}: call register() first (or it was closed)")
        return box


@contextlib.contextmanager
def ucx_environment(net_devices: str) -> Iterator[None]:
    """UCX_NET_DEVICES=`net_devices` while UCX reads its configuration (at backend creation):
    NIXL's own `ucx_devices` parameter does not keep UCX's TCP listener off other interfaces.
    An operator's UCX_NET_DEVICES in the environment wins; "" leaves UCX's default."""
    previous = os.environ.get(UCX_NET_DEVICES_ENV)
    if not net_devices or previous is not None:
        yield
        return
    os.environ[UCX_NET_DEVICES_ENV] = net_devices
    try:
        yield
    finally:
        del os.environ[UCX_NET_DEVICES_ENV]


def _strided_descs(
    base_addr: int, stride: int, length: int, count: int, device_id: int
) -> np.ndarray:
    """NIXL descriptors `[count, (addr, len, dev)]` for `count` regions `stride` bytes apart."""
    descs = np.empty((count, 3), dtype=np.uint64)
    descs[:, 0] = base_addr + stride * np.arange(count, dtype=np.uint64)
    descs[:, 1] = length
    descs[:, 2] = device_id
    return descs
