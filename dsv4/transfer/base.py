"""The `KVTransport` contract: move whole KV blocks from a prefill worker (P) to a decode worker (D).

Reading path: the dataclasses below, then `KVTransport`, then `ExportTable` (the lease check every
implementation shares) and `ExportingTransport` (`export` / `release` over it, with per-transport
hooks), then one implementation (`local.py` is the shortest).

The KV cache is one backing tensor `[num_blocks, block_stride_bytes]` (uint8) per worker, and one
block is one transfer descriptor. P exports a request's block ids under a lease; D pulls (READ) them
into its own block ids and P hears about it from `progress()`. The transport knows no layers.

Lease check (why a pull after `release` fails even over one-sided READ): every export owns a slot
in P's small int64 table holding a random token; `release` zeroes it. D copies the data, THEN reads
the slot, and accepts the data only if the token still matches. P zeroes the slot before it can
reuse the blocks, so a pull that overlapped a release is always reported FAILED, never silently
wrong. The slot read carries the "pulled" notice to P.
"""

from __future__ import annotations

import base64
import enum
import json
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from dsv4.errors import InvalidRequest, LayoutMismatch, ResourceExhausted, TransferError

WIRE_VERSION = 2  # 2: ExportedBlocks.grant


class PullStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class TransferStats:
    num_bytes: int
    seconds: float

    @property
    def bytes_per_s(self) -> float:
        return self.num_bytes / self.seconds if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class PullState:
    status: PullStatus
    message: str = ""
    stats: TransferStats | None = None  # set when DONE

    @property
    def is_finished(self) -> bool:
        return self.status is not PullStatus.PENDING


@dataclass(frozen=True)
class TransportEndpoint:
    """What D needs to reach P's memory. `peer_id` changes on every process start (restart
    detection); `payload` is kind-specific (NIXL agent metadata + region addresses, or CUDA IPC
    handles) and opaque to callers. Carry it as `to_bytes()` in a protobuf bytes field."""

    kind: str  # "local" | "nixl" | "cuda_ipc"
    peer_id: str
    num_blocks: int
    block_stride_bytes: int
    payload: bytes = b""

    def to_bytes(self) -> bytes:
        fields = {**self.__dict__, "payload": base64.b64encode(self.payload).decode()}
        return json.dumps({"v": WIRE_VERSION, **fields}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> TransportEndpoint:
        fields = _load_versioned(data, cls.__name__)
        return _build(cls, fields, payload=base64.b64decode(fields.get("payload", "")))


@dataclass(frozen=True)
class ExportedBlocks:
    """P's answer to `export`: which blocks hold the request's KV, and the lease slot/token that
    D checks after its copy. Plain values only; carry it as `to_bytes()`."""

    request_id: str
    peer_id: str
    block_ids: tuple[int, ...]
    bytes_per_block: int  # the prefix of each block that is moved
    lease_slot: int
    lease_token: int
    grant: bytes = b""  # NIXL: partial agent metadata naming just these blocks (one lease)

    @property
    def num_bytes(self) -> int:
        return len(self.block_ids) * self.bytes_per_block

    def to_bytes(self) -> bytes:
        grant = base64.b64encode(self.grant).decode()
        fields = {**self.__dict__, "block_ids": list(self.block_ids), "grant": grant}
        return json.dumps({"v": WIRE_VERSION, **fields}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> ExportedBlocks:
        fields = _load_versioned(data, cls.__name__)
        return _build(
            cls, fields, block_ids=tuple(int(i) for i in fields.get("block_ids", ())),
            grant=base64.b64decode(fields.get("grant", "")),
        )  # fmt: skip


@dataclass(frozen=True)
class PullHandle:
    pull_id: int
    request_id: str
    peer_id: str
    num_bytes: int


@dataclass(frozen=True)
class TransportUsage:
    """Live state, for leak checks and metrics. All zero after `close()`."""

    num_exports: int
    num_pending_pulls: int
    num_peers: int
    num_abandoned_xfers: int = 0  # transfers NIXL could not cancel after a failure
    num_grants: int = 0  # NIXL: leases whose blocks are registered for remote READs


@runtime_checkable
class KVTransport(Protocol):
    """Moves whole KV blocks P -> D. Every method is thread-safe (one internal lock) and returns
    quickly: nothing waits on the network except `close()`. Errors are `dsv4.errors` types."""

    kind: str

    def register(self, backing: torch.Tensor) -> None:
        """Called once by the worker at startup with its KV backing tensor
        `[num_blocks, block_stride_bytes]` uint8 (CPU or CUDA). Raises `InvalidRequest` for a bad
        tensor and `TransferError` when the transport cannot be set up (no NIXL, no GPU)."""

    def endpoint(self) -> TransportEndpoint:
        """Called by the worker after `register`, to publish in discovery / Info replies."""

    def export(
        self, request_id: str, block_ids: list[int], bytes_per_block: int | None = None
    ) -> ExportedBlocks:
        """P side, when a prefill finishes: put the blocks under a lease so D may pull them.
        `bytes_per_block` (default: the whole stride) limits the copy to a prefix of each block.
        The caller keeps the blocks untouched until `release`. Raises `InvalidRequest` (bad or
        duplicate ids) or `ResourceExhausted` (lease table full)."""

    def release(self, request_id: str) -> bool:
        """P side: drop the export (pulled, aborted or lease expired). After it returns, the blocks
        may be reused: a pull that races it reports FAILED. Returns False if it was unknown."""

    def progress(self) -> list[str]:
        """P side, called periodically (every ~1-10 ms while exports are live) by ONE service
        thread: drives the transport and returns the request ids D has pulled since the last call
        (the caller then `release`s them). A transport without a notice channel (cuda_ipc)
        returns [] and P learns of pulls from D's Release call. Never raises for peer trouble."""

    def start_pull(
        self,
        src: TransportEndpoint,
        exported: ExportedBlocks,
        dst_block_ids: list[int],
        timeout_s: float | None = None,
    ) -> PullHandle:
        """D side, when a decode request arrives: start copying `exported` into `dst_block_ids`
        of the registered backing; returns at once. Raises `LayoutMismatch` (block stride differs),
        `InvalidRequest` (bad ids) or `TransferError` (cannot reach the peer)."""

    def poll(self, handle: PullHandle) -> PullState:
        """D side, until finished: PENDING, DONE (with stats) or FAILED (with a message: peer gone,
        timed out, export released/unknown). A dead peer gives FAILED within `timeout_s`, never a
        hang. The finished state is reported once; polling again raises `NotFound`. Only after
        it is finished may the caller reuse `dst_block_ids`."""

    def usage(self) -> TransportUsage:
        """Any thread, any time: counts of live exports, pending pulls and peers."""

    def close(self) -> None:
        """At shutdown: fail pending pulls, drop exports, deregister memory. Idempotent."""


def wait_pull(
    transport: KVTransport, handle: PullHandle, poll_interval_s: float = 0.0005
) -> PullState:
    """Poll until finished (the transport's own timeout bounds the wait). For tests and tools."""
    while True:
        state = transport.poll(handle)
        if state.is_finished:
            return state
        time.sleep(poll_interval_s)


class ExportTable:
    """P-side lease slots over an int64 token tensor `[max_exports]` that D can read remotely."""

    def __init__(self, tokens: torch.Tensor, num_blocks: int, block_stride_bytes: int) -> None:
        assert tokens.dtype == torch.int64 and tokens.dim() == 1
        self.tokens = tokens
        self.num_blocks = num_blocks
        self.block_stride_bytes = block_stride_bytes
        self._free_slots = list(range(tokens.numel() - 1, -1, -1))
        self._by_request: dict[str, ExportedBlocks] = {}
        self._by_slot: dict[int, ExportedBlocks] = {}

    @classmethod
    def beside(cls, backing: torch.Tensor, max_exports: int) -> ExportTable:
        """A table whose tokens `[max_exports]` live on the backing's device."""
        tokens = torch.zeros(max_exports, dtype=torch.int64, device=backing.device)
        return cls(tokens, backing.shape[0], backing.shape[1])

    def __len__(self) -> int:
        return len(self._by_request)

    def add(
        self, peer_id: str, request_id: str, block_ids: list[int], bytes_per_block: int | None
    ) -> ExportedBlocks:
        if request_id in self._by_request:
            raise InvalidRequest(f"request {request_id!r} is already exported; release it first")
        checked_ids = check_block_ids(block_ids, self.num_blocks, "export")
        nbytes = self.block_stride_bytes if bytes_per_block is None else int(bytes_per_block)
        if not 0 < nbytes <= self.block_stride_bytes:
            raise InvalidRequest(
                f"bytes_per_block={nbytes} must be in 1..{self.block_stride_bytes} (block stride)"
            )
        if not self._free_slots:
            raise ResourceExhausted(
                f"all {self.tokens.numel()} export lease slots are in use; release pulled or "
                "expired requests, or raise max_exports",
                retry_after_s=0.1,
            )
        slot = self._free_slots.pop()
        token = secrets.randbits(62) + 1
        self._write(slot, token)
        exported = ExportedBlocks(request_id, peer_id, checked_ids, nbytes, slot, token)
        self._by_request[request_id] = exported
        self._by_slot[slot] = exported
        return exported

    def remove(self, request_id: str) -> bool:
        exported = self._by_request.pop(request_id, None)
        if exported is None:
            return False
        del self._by_slot[exported.lease_slot]
        self._write(exported.lease_slot, 0)
        self._free_slots.append(exported.lease_slot)
        return True

    def is_live(self, lease_slot: int, lease_token: int) -> bool:
        return 0 <= lease_slot < self.tokens.numel() and int(self.tokens[lease_slot]) == lease_token

    def request_for(self, lease_slot: int, lease_token: int) -> str | None:
        exported = self._by_slot.get(lease_slot)
        return exported.request_id if exported and exported.lease_token == lease_token else None

    def clear(self) -> None:
        for request_id in list(self._by_request):
            self.remove(request_id)

    def _write(self, slot: int, token: int) -> None:
        self.tokens[slot] = token
        if self.tokens.is_cuda:
            # NOTE: the zero must be visible to D before the caller may reuse the blocks.
            torch.cuda.synchronize(self.tokens.device)


class ExportingTransport:
    """The P side every transport shares: `export` / `release` through its `ExportTable`, under its
    lock. A transport sets `peer_id`, `_lock` and `_exports` (None before `register` and after
    `close`); what it registers per lease (NIXL: a grant of the blocks) goes in the hooks."""

    peer_id: str
    _lock: threading.RLock
    _exports: ExportTable | None

    def export(
        self, request_id: str, block_ids: list[int], bytes_per_block: int | None = None
    ) -> ExportedBlocks:
        with self._lock:
            exports = self._exports
            if exports is None:
                raise TransferError(f"{self.peer_id}: call register() first (or it was closed)")
            exported = exports.add(self.peer_id, request_id, block_ids, bytes_per_block)
            try:
                return self._grant(exported)
            except Exception:
                exports.remove(request_id)
                raise

    def release(self, request_id: str) -> bool:
        """Zero the lease slot (a racing pull reports FAILED), then `_revoke` the lease."""
        with self._lock:
            if self._exports is None or not self._exports.remove(request_id):
                return False
            self._revoke(request_id)
            return True

    def _grant(self, exported: ExportedBlocks) -> ExportedBlocks:
        """Hook, under the lock: register one new lease; raising undoes the export."""
        return exported

    def _revoke(self, request_id: str) -> None:
        """Hook, under the lock: undo `_grant` once the lease slot is zeroed."""

    def _num_exports(self) -> int:
        return len(self._exports) if self._exports is not None else 0

    def _drop_exports(self) -> None:
        """At `close`, under the lock: zero every lease slot and forget the table."""
        if self._exports is not None:
            self._exports.clear()
        self._exports = None


def check_backing(backing: torch.Tensor) -> None:
    if backing.dim() != 2 or backing.dtype != torch.uint8 or not backing.is_contiguous():
        raise InvalidRequest(
            f"KV backing must be a contiguous uint8 [num_blocks, block_stride_bytes] tensor, got "
            f"{backing.dtype} {tuple(backing.shape)} contiguous={backing.is_contiguous()}"
        )


def check_block_ids(block_ids: list[int], num_blocks: int, what: str) -> tuple[int, ...]:
    ids = tuple(int(i) for i in block_ids)
    if not ids:
        raise InvalidRequest(f"{what}: empty block id list")
    if len(set(ids)) != len(ids):
        raise InvalidRequest(f"{what}: duplicate block ids {sorted(ids)}")
    bad = [i for i in ids if not 0 <= i < num_blocks]
    if bad:
        raise InvalidRequest(f"{what}: block ids {bad[:8]} outside 0..{num_blocks - 1}")
    return ids


def check_pull_args(
    src: TransportEndpoint,
    exported: ExportedBlocks,
    dst_block_ids: list[int],
    kind: str,
    dst_num_blocks: int,
    dst_block_stride_bytes: int,
) -> tuple[int, ...]:
    """Validation shared by every `start_pull`; returns the checked destination ids."""
    if src.kind != kind:
        raise TransferError(f"endpoint of kind {src.kind!r} cannot be pulled by a {kind} transport")
    if exported.peer_id != src.peer_id:
        raise TransferError(
            f"request {exported.request_id!r} was exported by {exported.peer_id}, not by the "
            f"endpoint's peer {src.peer_id} (stale handle after a restart?)"
        )
    if src.block_stride_bytes != dst_block_stride_bytes:
        raise LayoutMismatch(
            f"block stride differs: P {src.block_stride_bytes} B, D {dst_block_stride_bytes} B"
        )
    dst_ids = check_block_ids(dst_block_ids, dst_num_blocks, "pull destination")
    if len(dst_ids) != len(exported.block_ids):
        raise InvalidRequest(
            f"pull of {exported.request_id!r}: {len(exported.block_ids)} source blocks but "
            f"{len(dst_ids)} destination blocks"
        )
    check_block_ids(list(exported.block_ids), src.num_blocks, "pull source")
    return dst_ids


def copy_blocks(
    src: torch.Tensor,
    src_ids: tuple[int, ...],
    dst: torch.Tensor,
    dst_ids: tuple[int, ...],
    nbytes: int,
) -> None:
    """dst[dst_ids[i], :nbytes] = src[src_ids[i], :nbytes] for two `[num_blocks, stride]` tensors."""
    if src.is_cuda or dst.is_cuda:
        src_index = torch.tensor(src_ids, dtype=torch.long, device=src.device)
        dst_index = torch.tensor(dst_ids, dtype=torch.long, device=dst.device)
        rows = src[:, :nbytes].index_select(0, src_index)  # [num_ids, nbytes]
        dst[:, :nbytes].index_copy_(0, dst_index, rows.to(dst.device, non_blocking=True))
        return
    # NOTE: on CPU one memcpy per block is ~3x faster than index_select on uint8 rows.
    for src_id, dst_id in zip(src_ids, dst_ids):
        dst[dst_id, :nbytes].copy_(src[src_id, :nbytes])


def _build(cls, fields: dict, **converted):
    try:
        return cls(**{**fields, **converted})
    except TypeError as exc:
        raise InvalidRequest(f"cannot decode {cls.__name__}: {exc}") from exc


def _load_versioned(data: bytes, what: str) -> dict:
    try:
        fields = json.loads(data)
        version = fields.pop("v")
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidRequest(f"cannot decode {what}: {exc}") from exc
    if version != WIRE_VERSION:
        raise InvalidRequest(f"{what} wire version {version} != {WIRE_VERSION}; upgrade the peer")
    return fields
