from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransportKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_KIND_UNSPECIFIED: _ClassVar[TransportKind]
    TRANSPORT_KIND_NIXL: _ClassVar[TransportKind]
    TRANSPORT_KIND_CUDA_IPC: _ClassVar[TransportKind]
    TRANSPORT_KIND_LOCAL: _ClassVar[TransportKind]
TRANSPORT_KIND_UNSPECIFIED: TransportKind
TRANSPORT_KIND_NIXL: TransportKind
TRANSPORT_KIND_CUDA_IPC: TransportKind
TRANSPORT_KIND_LOCAL: TransportKind

class KVLayoutInfo(_message.Message):
    __slots__ = ("version", "compat_hash", "block_stride_bytes", "block_size_tokens")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    version: int
    compat_hash: str
    block_stride_bytes: int
    block_size_tokens: int
    def __init__(self, version: _Optional[int] = ..., compat_hash: _Optional[str] = ..., block_stride_bytes: _Optional[int] = ..., block_size_tokens: _Optional[int] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("request_id", "prefill_worker_id", "transport_kind", "transport_endpoint", "transport_metadata", "serialized_descriptors", "block_ids", "layout_hash", "num_tokens", "lease_id", "lease_expires_at_unix_ms", "prefill_address")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_KIND_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_METADATA_FIELD_NUMBER: _ClassVar[int]
    SERIALIZED_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill_worker_id: str
    transport_kind: TransportKind
    transport_endpoint: str
    transport_metadata: bytes
    serialized_descriptors: bytes
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    layout_hash: str
    num_tokens: int
    lease_id: str
    lease_expires_at_unix_ms: int
    prefill_address: str
    def __init__(self, request_id: _Optional[str] = ..., prefill_worker_id: _Optional[str] = ..., transport_kind: _Optional[_Union[TransportKind, str]] = ..., transport_endpoint: _Optional[str] = ..., transport_metadata: _Optional[bytes] = ..., serialized_descriptors: _Optional[bytes] = ..., block_ids: _Optional[_Iterable[int]] = ..., layout_hash: _Optional[str] = ..., num_tokens: _Optional[int] = ..., lease_id: _Optional[str] = ..., lease_expires_at_unix_ms: _Optional[int] = ..., prefill_address: _Optional[str] = ...) -> None: ...
