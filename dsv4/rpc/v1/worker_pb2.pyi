from dsv4.rpc.v1 import common_pb2 as _common_pb2
from dsv4.rpc.v1 import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PullFailurePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PULL_FAILURE_POLICY_UNSPECIFIED: _ClassVar[PullFailurePolicy]
    PULL_FAILURE_POLICY_RECOMPUTE: _ClassVar[PullFailurePolicy]
    PULL_FAILURE_POLICY_FAIL: _ClassVar[PullFailurePolicy]
PULL_FAILURE_POLICY_UNSPECIFIED: PullFailurePolicy
PULL_FAILURE_POLICY_RECOMPUTE: PullFailurePolicy
PULL_FAILURE_POLICY_FAIL: PullFailurePolicy

class TokenizedRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "deadline_unix_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: int
    deadline_unix_ms: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: TokenizedRequest
    def __init__(self, request: _Optional[_Union[TokenizedRequest, _Mapping]] = ...) -> None: ...

class PrefillTimings(_message.Message):
    __slots__ = ("queue_ms", "compute_ms", "num_chunks")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    compute_ms: float
    num_chunks: int
    def __init__(self, queue_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., num_chunks: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_token_text", "handle", "timings", "first_token_logprobs", "prompt_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TEXT_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_token_text: str
    handle: _kv_pb2.KVHandle
    timings: PrefillTimings
    first_token_logprobs: _common_pb2.TokenLogprobs
    prompt_logprobs: _common_pb2.PromptLogprobs
    def __init__(self, first_token_id: _Optional[int] = ..., first_token_text: _Optional[str] = ..., handle: _Optional[_Union[_kv_pb2.KVHandle, _Mapping]] = ..., timings: _Optional[_Union[PrefillTimings, _Mapping]] = ..., first_token_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.PromptLogprobs, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "request_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    request_id: str
    def __init__(self, lease_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("was_found", "num_freed_blocks")
    WAS_FOUND_FIELD_NUMBER: _ClassVar[int]
    NUM_FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    was_found: bool
    num_freed_blocks: int
    def __init__(self, was_found: _Optional[bool] = ..., num_freed_blocks: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request", "first_token_id", "handle", "pull_failure_policy")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    PULL_FAILURE_POLICY_FIELD_NUMBER: _ClassVar[int]
    request: TokenizedRequest
    first_token_id: int
    handle: _kv_pb2.KVHandle
    pull_failure_policy: PullFailurePolicy
    def __init__(self, request: _Optional[_Union[TokenizedRequest, _Mapping]] = ..., first_token_id: _Optional[int] = ..., handle: _Optional[_Union[_kv_pb2.KVHandle, _Mapping]] = ..., pull_failure_policy: _Optional[_Union[PullFailurePolicy, str]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "usage", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    prompt_logprobs: _common_pb2.PromptLogprobs
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.PromptLogprobs, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "transport_kind", "transport_endpoint", "layout", "num_free_blocks", "num_total_blocks", "num_queued_tokens", "num_running_requests", "num_leases", "is_draining", "model_name", "vocab_size", "max_model_len", "updated_at_unix_ms", "speculative_method")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_KIND_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    IS_DRAINING_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_METHOD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _common_pb2.WorkerRole
    address: str
    transport_kind: _kv_pb2.TransportKind
    transport_endpoint: str
    layout: _kv_pb2.KVLayoutInfo
    num_free_blocks: int
    num_total_blocks: int
    num_queued_tokens: int
    num_running_requests: int
    num_leases: int
    is_draining: bool
    model_name: str
    vocab_size: int
    max_model_len: int
    updated_at_unix_ms: int
    speculative_method: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., address: _Optional[str] = ..., transport_kind: _Optional[_Union[_kv_pb2.TransportKind, str]] = ..., transport_endpoint: _Optional[str] = ..., layout: _Optional[_Union[_kv_pb2.KVLayoutInfo, _Mapping]] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_queued_tokens: _Optional[int] = ..., num_running_requests: _Optional[int] = ..., num_leases: _Optional[int] = ..., is_draining: _Optional[bool] = ..., model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., updated_at_unix_ms: _Optional[int] = ..., speculative_method: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UndrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("num_running_requests", "num_leases")
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    num_running_requests: int
    num_leases: int
    def __init__(self, num_running_requests: _Optional[int] = ..., num_leases: _Optional[int] = ...) -> None: ...
