"""Conversions for the KV hand-off (kv.proto): the handle D pulls with, and the layout summary."""

from __future__ import annotations

from dsv4.errors import InvalidRequest
from dsv4.rpc.v1 import kv_pb2
from dsv4.types import KVHandle, KVLayoutInfo
from dsv4.wire.common import TRANSPORT_KIND_TO_PB, enum_from_pb


def kv_layout_to_proto(layout: KVLayoutInfo) -> kv_pb2.KVLayoutInfo:
    return kv_pb2.KVLayoutInfo(
        version=layout.version,
        compat_hash=layout.compat_hash,
        block_stride_bytes=layout.block_stride_bytes,
        block_size_tokens=layout.block_size_tokens,
    )


def kv_layout_from_proto(msg: kv_pb2.KVLayoutInfo) -> KVLayoutInfo:
    return KVLayoutInfo(
        version=msg.version,
        compat_hash=msg.compat_hash,
        block_stride_bytes=msg.block_stride_bytes,
        block_size_tokens=msg.block_size_tokens,
    )


def kv_handle_to_proto(handle: KVHandle) -> kv_pb2.KVHandle:
    return kv_pb2.KVHandle(
        request_id=handle.request_id,
        prefill_worker_id=handle.prefill_worker_id,
        transport_kind=TRANSPORT_KIND_TO_PB[handle.transport_kind],
        transport_endpoint=handle.transport_endpoint,
        transport_metadata=handle.transport_metadata,
        serialized_descriptors=handle.serialized_descriptors,
        block_ids=handle.block_ids,
        layout_hash=handle.layout_hash,
        num_tokens=handle.num_tokens,
        lease_id=handle.lease_id,
        lease_expires_at_unix_ms=handle.lease_expires_at_unix_ms,
        prefill_address=handle.prefill_address,
    )


def kv_handle_from_proto(msg: kv_pb2.KVHandle) -> KVHandle:
    """Validate the fields a pull cannot do without."""
    for name in ("request_id", "prefill_worker_id", "layout_hash", "lease_id"):
        if not getattr(msg, name):
            raise InvalidRequest(f"KVHandle.{name} is empty: pass the handle Prefill returned")
    if msg.num_tokens < 1 or not msg.block_ids or min(msg.block_ids) < 0:
        raise InvalidRequest(
            f"KVHandle names {len(msg.block_ids)} blocks for {msg.num_tokens} tokens: "
            "a handle needs at least one token and non-negative block ids"
        )
    return KVHandle(
        request_id=msg.request_id,
        prefill_worker_id=msg.prefill_worker_id,
        transport_kind=enum_from_pb(TRANSPORT_KIND_TO_PB, msg.transport_kind, "transport_kind"),
        transport_endpoint=msg.transport_endpoint,
        block_ids=tuple(msg.block_ids),
        layout_hash=msg.layout_hash,
        num_tokens=msg.num_tokens,
        lease_id=msg.lease_id,
        lease_expires_at_unix_ms=msg.lease_expires_at_unix_ms,
        prefill_address=msg.prefill_address,
        transport_metadata=msg.transport_metadata,
        serialized_descriptors=msg.serialized_descriptors,
    )
