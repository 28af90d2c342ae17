"""Conversions for the internal `PrefillWorker` / `DecodeWorker` APIs.

Workers re-validate what the router sends (a worker never crashes on a bad request), with
limits from their own model.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from dsv4.errors import InvalidRequest
from dsv4.rpc.v1 import worker_pb2
from dsv4.types import (
    DecodeRequest,
    DrainStatus,
    GenerateRequest,
    PrefillResult,
    PrefillTimings,
    ReleaseRequest,
    ReleaseResult,
    RequestLimits,
    StreamChunk,
    WorkerInfo,
)
from dsv4.wire.common import (
    PULL_FAILURE_POLICY_TO_PB,
    TRANSPORT_KIND_TO_PB,
    WORKER_ROLE_TO_PB,
    chunk_from_proto,
    enum_from_pb,
    fill_chunk_proto,
    prompt_logprobs_field,
    prompt_logprobs_to_proto,
    sampling_from_proto,
    sampling_to_proto,
    token_logprobs_from_proto,
    token_logprobs_to_proto,
)
from dsv4.wire.kv import (
    kv_handle_from_proto,
    kv_handle_to_proto,
    kv_layout_from_proto,
    kv_layout_to_proto,
)
from dsv4.wire.validate import check_prompt_token_ids, check_request_id, check_token_ids_in_vocab

# ---- requests -----------------------------------------------------------------------------------


def tokenized_request_to_proto(request: GenerateRequest) -> worker_pb2.TokenizedRequest:
    return worker_pb2.TokenizedRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling=sampling_to_proto(request.sampling),
        priority=request.priority,
        deadline_unix_ms=request.deadline_unix_ms or 0,
    )


def tokenized_request_from_proto(
    msg: worker_pb2.TokenizedRequest, limits: RequestLimits
) -> GenerateRequest:
    request_id = check_request_id(msg.request_id, limits, may_assign=False)
    prompt = check_prompt_token_ids(msg.prompt_token_ids, limits)
    return GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=sampling_from_proto(msg.sampling, limits, len(prompt)),
        priority=msg.priority,
        deadline_unix_ms=msg.deadline_unix_ms or None,
    )


def prefill_request_to_proto(request: GenerateRequest) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(request=tokenized_request_to_proto(request))


def prefill_request_from_proto(
    msg: worker_pb2.PrefillRequest, limits: RequestLimits
) -> GenerateRequest:
    return tokenized_request_from_proto(msg.request, limits)


def decode_request_to_proto(request: DecodeRequest) -> worker_pb2.DecodeRequest:
    msg = worker_pb2.DecodeRequest(
        request=tokenized_request_to_proto(request.request),
        pull_failure_policy=PULL_FAILURE_POLICY_TO_PB[request.pull_failure_policy],
    )
    if request.first_token_id is not None:
        msg.first_token_id = request.first_token_id
    if request.handle is not None:
        msg.handle.CopyFrom(kv_handle_to_proto(request.handle))
    return msg


def decode_request_from_proto(
    msg: worker_pb2.DecodeRequest, limits: RequestLimits
) -> DecodeRequest:
    """Validate; first_token_id and handle come together or not at all (local prefill)."""
    request = tokenized_request_from_proto(msg.request, limits)
    has_first, has_handle = msg.HasField("first_token_id"), msg.HasField("handle")
    if has_first != has_handle:
        raise InvalidRequest(
            "DecodeRequest: send first_token_id together with handle (prefilled elsewhere), "
            "or neither (the decode worker prefills itself)"
        )
    handle = None
    if has_handle:
        check_token_ids_in_vocab("first_token_id", [msg.first_token_id], limits.vocab_size)
        handle = kv_handle_from_proto(msg.handle)
        if handle.request_id != request.request_id:
            raise InvalidRequest(
                f"DecodeRequest: handle belongs to request {handle.request_id!r}, not "
                f"{request.request_id!r}: pass the handle Prefill returned for this request"
            )
        if handle.num_tokens != request.num_prompt_tokens:
            raise InvalidRequest(
                f"DecodeRequest: handle holds KV of {handle.num_tokens} tokens but the prompt "
                f"has {request.num_prompt_tokens}: pass the handle Prefill returned"
            )
    return DecodeRequest(
        request=request,
        first_token_id=msg.first_token_id if has_first else None,
        handle=handle,
        pull_failure_policy=enum_from_pb(
            PULL_FAILURE_POLICY_TO_PB, msg.pull_failure_policy, "pull_failure_policy"
        ),
    )


def release_request_to_proto(request: ReleaseRequest) -> worker_pb2.ReleaseRequest:
    return worker_pb2.ReleaseRequest(lease_id=request.lease_id, request_id=request.request_id)


def release_request_from_proto(msg: worker_pb2.ReleaseRequest) -> ReleaseRequest:
    if not msg.lease_id:
        raise InvalidRequest("ReleaseRequest.lease_id is empty: pass KVHandle.lease_id")
    return ReleaseRequest(lease_id=msg.lease_id, request_id=msg.request_id)


# ---- responses ----------------------------------------------------------------------------------


def prefill_result_to_proto(result: PrefillResult) -> worker_pb2.PrefillResponse:
    t = result.timings
    msg = worker_pb2.PrefillResponse(
        first_token_id=result.first_token_id,
        first_token_text=result.first_token_text,
        handle=kv_handle_to_proto(result.handle),
        timings=worker_pb2.PrefillTimings(
            queue_ms=t.queue_ms, compute_ms=t.compute_ms, num_chunks=t.num_chunks
        ),
    )
    if result.first_token_logprobs is not None:
        msg.first_token_logprobs.CopyFrom(token_logprobs_to_proto(result.first_token_logprobs))
    if result.prompt_logprobs is not None:
        msg.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(result.prompt_logprobs))
    return msg


def prefill_result_from_proto(msg: worker_pb2.PrefillResponse) -> PrefillResult:
    if not msg.HasField("handle"):
        raise InvalidRequest("PrefillResponse has no handle: the prefill worker must send one")
    t = msg.timings
    return PrefillResult(
        first_token_id=msg.first_token_id,
        handle=kv_handle_from_proto(msg.handle),
        timings=PrefillTimings(
            queue_ms=t.queue_ms, compute_ms=t.compute_ms, num_chunks=t.num_chunks
        ),
        first_token_text=msg.first_token_text,
        first_token_logprobs=token_logprobs_from_proto(msg.first_token_logprobs)
        if msg.HasField("first_token_logprobs")
        else None,
        prompt_logprobs=prompt_logprobs_field(msg),
    )


def decode_response_to_proto(chunk: StreamChunk) -> worker_pb2.DecodeResponse:
    return fill_chunk_proto(worker_pb2.DecodeResponse(), chunk)


def decode_response_from_proto(msg: worker_pb2.DecodeResponse) -> StreamChunk:
    return chunk_from_proto(msg)


def release_result_to_proto(result: ReleaseResult) -> worker_pb2.ReleaseResponse:
    return worker_pb2.ReleaseResponse(
        was_found=result.was_found, num_freed_blocks=result.num_freed_blocks
    )


def release_result_from_proto(msg: worker_pb2.ReleaseResponse) -> ReleaseResult:
    return ReleaseResult(was_found=msg.was_found, num_freed_blocks=msg.num_freed_blocks)


def drain_status_to_proto(status: DrainStatus) -> worker_pb2.DrainResponse:
    return worker_pb2.DrainResponse(
        num_running_requests=status.num_running_requests, num_leases=status.num_leases
    )


def drain_status_from_proto(msg: worker_pb2.DrainResponse) -> DrainStatus:
    return DrainStatus(num_running_requests=msg.num_running_requests, num_leases=msg.num_leases)


# ---- worker info (Info answers and discovery records) -------------------------------------------

_WORKER_INFO_SCALARS = (
    "worker_id",
    "address",
    "transport_endpoint",
    "num_free_blocks",
    "num_total_blocks",
    "num_queued_tokens",
    "num_running_requests",
    "num_leases",
    "is_draining",
    "model_name",
    "vocab_size",
    "max_model_len",
    "updated_at_unix_ms",
    "speculative_method",
)


def worker_info_to_proto(info: WorkerInfo) -> worker_pb2.WorkerInfo:
    msg = worker_pb2.WorkerInfo(
        role=WORKER_ROLE_TO_PB[info.role],
        transport_kind=TRANSPORT_KIND_TO_PB[info.transport_kind],
        **{name: getattr(info, name) for name in _WORKER_INFO_SCALARS},
    )
    if info.layout is not None:
        msg.layout.CopyFrom(kv_layout_to_proto(info.layout))
    return msg


def worker_info_from_proto(msg: worker_pb2.WorkerInfo) -> WorkerInfo:
    if not msg.worker_id or not msg.address:
        raise InvalidRequest("WorkerInfo needs worker_id and address: fix the worker's config")
    return WorkerInfo(
        role=enum_from_pb(WORKER_ROLE_TO_PB, msg.role, "role"),
        transport_kind=enum_from_pb(TRANSPORT_KIND_TO_PB, msg.transport_kind, "transport_kind"),
        layout=kv_layout_from_proto(msg.layout) if msg.HasField("layout") else None,
        **{name: getattr(msg, name) for name in _WORKER_INFO_SCALARS},
    )


def encode_worker_info(info: WorkerInfo) -> bytes:
    """Serialized WorkerInfo proto, e.g. for a discovery record in Redis."""
    return worker_info_to_proto(info).SerializeToString()


def decode_worker_info(data: bytes) -> WorkerInfo:
    msg = worker_pb2.WorkerInfo()
    try:
        msg.ParseFromString(data)
    except DecodeError as exc:
        raise InvalidRequest(f"WorkerInfo record does not parse ({exc}): republish it") from exc
    return worker_info_from_proto(msg)
