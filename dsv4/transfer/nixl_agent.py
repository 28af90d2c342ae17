"""`NixlAgentBox`: the NIXL agent of one worker and what is registered, granted and prepped on it.

Per-lease grants (what a peer can address):
- The whole KV backing is registered once as this worker's own READ destination (D side); its
  memory keys never leave the process: the metadata we hand out is partial.
- `public_metadata()` is the connection info plus the lease-slot (control) tensor: all a peer
  learns from an endpoint.
- `grant(request_id, blocks)` registers just those blocks (contiguous runs merged) and returns
  partial metadata for them; it travels to the one D the router names, inside the authenticated
  Prefill answer. `revoke(request_id)` deregisters them when the lease ends.
- A peer that loaded only the public metadata, or another lease's grant, cannot prepare a READ
  of the blocks (NIXL refuses descriptors outside the remote regions it knows).

What this cannot restrict (docs/operations.md, "Security model"): UCX checks memory keys in
hardware only on RDMA NICs (where deregistration revokes them). Over TCP and shared memory it
does not: a process that once held a grant can read the same addresses after `revoke`, and a
local process of the same user can read the worker's memory without NIXL at all.

Callers hold the transport's lock; every method runs on the caller's thread.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dsv4.errors import TransferError

logger = logging.getLogger(__name__)

BACKEND = "UCX"
UCX_NET_DEVICES_ENV = "UCX_NET_DEVICES"


def _nixl_api() -> tuple[type, type]:
    """`nixl_agent`, `nixl_agent_config` from whichever NIXL build is installed: the `nixl`
    meta-package (it picks a build by CUDA version), else `nixl-cu13` or `nixl-cu12` alone (what
    the worker extra installs; either runs UCX on a CPU-only host)."""
    missing = []
    for module in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            api = importlib.import_module(module)
        except ImportError as exc:  # the meta-package raises it when its CUDA build is absent
            missing.append(str(exc))
            continue
        return api.nixl_agent, api.nixl_agent_config
    raise TransferError(f"NIXL is not installed ({'; '.join(missing)}): pip install nixl-cu13")


@dataclass
class Peer:
    """A remote agent we READ from: its name, its region addresses, our prepped handles."""

    name: str
    region: dict
    control_dlist: object | None = None
    num_active_pulls: int = 0
    failure: str | None = None


class NixlAgentBox:
    def __init__(
        self,
        name: str,
        backing: torch.Tensor,
        control: torch.Tensor,
        ucx_params: dict[str, str],
        net_devices: str = "",
    ) -> None:
        nixl_agent, nixl_agent_config = _nixl_api()
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        with ucx_environment(net_devices):
            self.agent.create_backend(BACKEND, ucx_params)
        self.backing_shape: tuple[int, int] = (backing.shape[0], backing.shape[1])
        self.region = {  # what D needs to address our memory; travels in the endpoint payload
            "data_addr": backing.data_ptr(),
            "data_mem": "VRAM" if backing.is_cuda else "DRAM",
            "device_id": (backing.device.index or 0) if backing.is_cuda else 0,
            "control_addr": control.data_ptr(),
            "num_slots": control.shape[1],
        }
        self._data_reg = self.agent.register_memory(backing)
        self._control_reg = self.agent.register_memory(control)
        self._grants: dict[str, object] = {}  # request id -> registration of its blocks
        self._peer_names: set[str] = set()  # remote agents loaded and still connected
        self._local_data_dlists: dict[int, object] = {}
        num_slots = control.shape[1]
        landing = strided_descs(control.data_ptr() + 8 * num_slots, 8, 8, num_slots, 0)
        self._local_landing = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", landing, "DRAM")
        self._abandoned_xfers: list[object] = []

    @property
    def num_abandoned_xfers(self) -> int:
        return len(self._abandoned_xfers)

    @property
    def num_grants(self) -> int:
        return len(self._grants)

    # ---- what peers may learn ----------------------------------------------------------------

    def public_metadata(self) -> bytes:
        """Connection info and the lease-slot tensor; no key to any KV block."""
        return self.agent.get_partial_agent_metadata(self._control_reg, True, [BACKEND])

    def grant(self, request_id: str, block_ids: Sequence[int], nbytes: int) -> bytes:
        """Register `nbytes` of each block for remote READs; the partial metadata naming them."""
        stride = self.backing_shape[1]
        mine = self.region
        descs = block_descs(mine["data_addr"], stride, nbytes, block_ids, mine["device_id"])
        registration = self.agent.register_memory(descs, mine["data_mem"])
        self._grants[request_id] = registration
        try:
            return self.agent.get_partial_agent_metadata(registration, False, [BACKEND])
        except Exception:
            self.revoke(request_id)
            raise

    def revoke(self, request_id: str) -> bool:
        """Deregister a lease's blocks (RDMA: their keys stop working)."""
        registration = self._grants.pop(request_id, None)
        if registration is None:
            return False
        try:
            self.agent.deregister_memory(registration)
        except Exception:
            logger.exception("NIXL: deregistering the grant of %r failed", request_id)
        return True

    # ---- peers -------------------------------------------------------------------------------

    def load_metadata(self, metadata: bytes, expected_name: str) -> str:
        """Load a peer's public metadata or one of its grants (merged into what we know)."""
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        if name != expected_name:
            if name not in self._peer_names:  # never drop a peer another pull relies on
                self.agent.remove_remote_agent(name)
            raise TransferError(f"metadata names agent {name!r}, endpoint says {expected_name!r}")
        self._peer_names.add(name)
        return name

    def remove_peer(self, peer: Peer) -> None:
        self._peer_names.discard(peer.name)
        if peer.control_dlist is not None:
            self.agent.release_dlist_handle(peer.control_dlist)
            peer.control_dlist = None
        try:
            self.agent.remove_remote_agent(peer.name)
        except Exception:
            logger.exception("removing NIXL peer %s failed", peer.name)

    # ---- transfers ---------------------------------------------------------------------------

    def make_data_read(
        self, peer: Peer, nbytes: int, dst_ids: tuple[int, ...], src_ids: tuple[int, ...]
    ) -> tuple[object, object]:
        """(READ of the peer's granted `src_ids` into our `dst_ids`, its remote dlist handle:
        release both when done). Raises when the blocks are not granted to us."""
        stride = self.backing_shape[1]  # P and D strides are equal (checked before any pull)
        local = self._local_data_dlists.get(nbytes)
        if local is None:
            mine = self.region
            descs = strided_descs(
                mine["data_addr"], stride, nbytes, self.backing_shape[0], mine["device_id"]
            )
            local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, mine["data_mem"])
            self._local_data_dlists[nbytes] = local
        theirs = peer.region
        descs = block_descs(theirs["data_addr"], stride, nbytes, src_ids, theirs["device_id"],
                            merge=False)  # fmt: skip
        remote = self.agent.prep_xfer_dlist(peer.name, descs, theirs["data_mem"])
        try:
            xfer = self.agent.make_prepped_xfer(
                "READ", local, np.asarray(dst_ids, np.int32), remote,
                np.arange(len(src_ids), dtype=np.int32),
            )  # fmt: skip
        except Exception:
            self.agent.release_dlist_handle(remote)
            raise
        return xfer, remote

    def make_check_read(
        self, peer: Peer, landing_slot: int, lease_slot: int, notice: bytes
    ) -> object:
        if peer.control_dlist is None:
            descs = strided_descs(peer.region["control_addr"], 8, 8, peer.region["num_slots"], 0)
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

    def release_dlist(self, dlist: object) -> None:
        try:
            self.agent.release_dlist_handle(dlist)
        except Exception:
            logger.exception("NIXL: releasing a descriptor list failed")

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
        for request_id in list(self._grants):
            self.revoke(request_id)
        for registration in (self._data_reg, self._control_reg):
            self.agent.deregister_memory(registration)
        del self.agent


@contextlib.contextmanager
def ucx_environment(net_devices: str) -> Iterator[None]:
    """UCX_NET_DEVICES=`net_devices` while UCX reads its configuration (at backend creation):
    NIXL's own `ucx_devices` parameter does not keep UCX's TCP listener off other interfaces.
    An operator's UCX_NET_DEVICES in the environment wins; "" leaves UCX's default."""
    if not net_devices or UCX_NET_DEVICES_ENV in os.environ:
        yield
        return
    os.environ[UCX_NET_DEVICES_ENV] = net_devices
    try:
        yield
    finally:
        del os.environ[UCX_NET_DEVICES_ENV]


def strided_descs(
    base_addr: int, stride: int, length: int, count: int, device_id: int
) -> np.ndarray:
    """NIXL descriptors `[count, (addr, len, dev)]` for `count` regions `stride` bytes apart."""
    descs = np.empty((count, 3), dtype=np.uint64)
    descs[:, 0] = base_addr + stride * np.arange(count, dtype=np.uint64)
    descs[:, 1] = length
    descs[:, 2] = device_id
    return descs


def block_descs(
    base_addr: int,
    stride: int,
    nbytes: int,
    block_ids: Sequence[int],
    device_id: int,
    *,
    merge: bool = True,
) -> np.ndarray:
    """Descriptors `[n, (addr, len, dev)]` of the first `nbytes` of each block; with `merge`
    and whole blocks, runs of consecutive ids become one region (fewer registrations)."""
    ids = sorted(block_ids) if merge and nbytes == stride else list(block_ids)
    runs: list[tuple[int, int]] = []  # (first id, length in bytes)
    for block_id in ids:
        if merge and nbytes == stride and runs and runs[-1][0] + runs[-1][1] // stride == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1] + stride)
        else:
            runs.append((block_id, nbytes))
    descs = np.empty((len(runs), 3), dtype=np.uint64)
    descs[:, 0] = [base_addr + stride * first for first, _ in runs]
    descs[:, 1] = [length for _, length in runs]
    descs[:, 2] = device_id
    return descs
