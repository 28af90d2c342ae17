"""Conversions for the types shared by every service: enums, sampling, usage, stream chunks."""

from __future__ import annotations

from typing import Any, TypeVar

from dsv4.errors import InvalidRequest
from dsv4.rpc.v1 import common_pb2, kv_pb2, worker_pb2
from dsv4.types import (
    FinishReason,
    PromptLogprobs,
    PullFailurePolicy,
    RequestLimits,
    SamplingParams,
    StreamChunk,
    TokenLogprobs,
    TransportKind,
    Usage,
    WorkerRole,
)
from dsv4.wire.validate import check_sampling

E = TypeVar("E")

FINISH_REASON_TO_PB = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}
WORKER_ROLE_TO_PB = {
    WorkerRole.PREFILL: common_pb2.WORKER_ROLE_PREFILL,
    WorkerRole.DECODE: common_pb2.WORKER_ROLE_DECODE,
    WorkerRole.COLOCATED: common_pb2.WORKER_ROLE_COLOCATED,
}
TRANSPORT_KIND_TO_PB = {
    TransportKind.NIXL: kv_pb2.TRANSPORT_KIND_NIXL,
    TransportKind.CUDA_IPC: kv_pb2.TRANSPORT_KIND_CUDA_IPC,
    TransportKind.LOCAL: kv_pb2.TRANSPORT_KIND_LOCAL,
}
PULL_FAILURE_POLICY_TO_PB = {
    PullFailurePolicy.RECOMPUTE: worker_pb2.PULL_FAILURE_POLICY_RECOMPUTE,
    PullFailurePolicy.FAIL: worker_pb2.PULL_FAILURE_POLICY_FAIL,
}


def enum_from_pb(table: dict[E, int], value: int, field_name: str) -> E:
    """Map a proto enum number back to our enum; UNSPECIFIED and unknown numbers are errors."""
    for ours, number in table.items():
        if number == value:
            return ours
    names = ", ".join(str(getattr(e, "value", e)) for e in table)
    raise InvalidRequest(
        f"{field_name} = {value} is unspecified or unknown: set one of {names} "
        "(a peer on a newer API version may send values this one does not know)"
    )


def finish_reason_from_pb(value: int) -> FinishReason | None:
    if value == common_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return enum_from_pb(FINISH_REASON_TO_PB, value, "finish_reason")


# ---- sampling ---------------------------------------------------------------------------------


def sampling_to_proto(sampling: SamplingParams) -> common_pb2.SamplingParams:
    """Every field set explicitly, so the receiver applies no defaults of its own."""
    msg = common_pb2.SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_new_tokens=sampling.max_new_tokens,
        stop_token_ids=sampling.stop_token_ids,
        stop=sampling.stop_strings,
        ignore_eos=sampling.ignore_eos,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty,
        logit_bias=dict(sampling.logit_bias),
    )
    if sampling.seed is not None:
        msg.seed = sampling.seed
    if sampling.logprobs is not None:
        msg.logprobs = sampling.logprobs
    if sampling.prompt_logprobs is not None:
        msg.prompt_logprobs = sampling.prompt_logprobs
    return msg


def sampling_from_proto(
    msg: common_pb2.SamplingParams, limits: RequestLimits, num_prompt_tokens: int
) -> SamplingParams:
    """Validate; unset optional fields take the defaults (max_new_tokens from `limits`)."""
    defaults = SamplingParams()
    return check_sampling(
        temperature=_given(msg, "temperature", defaults.temperature),
        top_p=_given(msg, "top_p", defaults.top_p),
        top_k=msg.top_k,
        max_new_tokens=msg.max_new_tokens if msg.HasField("max_new_tokens") else None,
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=list(msg.stop_token_ids),
        stop_strings=list(msg.stop),
        ignore_eos=msg.ignore_eos,
        num_prompt_tokens=num_prompt_tokens,
        limits=limits,
        presence_penalty=_given(msg, "presence_penalty", defaults.presence_penalty),
        frequency_penalty=_given(msg, "frequency_penalty", defaults.frequency_penalty),
        repetition_penalty=_given(msg, "repetition_penalty", defaults.repetition_penalty),
        logit_bias=dict(msg.logit_bias),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    )


def _given(msg: common_pb2.SamplingParams, name: str, default: float) -> float:
    return getattr(msg, name) if msg.HasField(name) else default


# ---- usage and stream chunks ------------------------------------------------------------------

_USAGE_FIELDS = tuple(Usage.__dataclass_fields__)


def usage_to_proto(usage: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(**{name: getattr(usage, name) for name in _USAGE_FIELDS})


def usage_from_proto(msg: common_pb2.Usage) -> Usage:
    return Usage(**{name: getattr(msg, name) for name in _USAGE_FIELDS})


def token_logprobs_to_proto(logprobs: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        logprob=logprobs.logprob,
        top_token_ids=[t for t, _ in logprobs.top],
        top_logprobs=[v for _, v in logprobs.top],
        rank=logprobs.rank,
    )


def token_logprobs_from_proto(msg: common_pb2.TokenLogprobs) -> TokenLogprobs:
    if len(msg.top_token_ids) != len(msg.top_logprobs):
        raise InvalidRequest(
            f"TokenLogprobs has {len(msg.top_token_ids)} top_token_ids but "
            f"{len(msg.top_logprobs)} top_logprobs: a peer must send one logprob per id"
        )
    rank = msg.rank if msg.HasField("rank") else None
    return TokenLogprobs(msg.logprob, tuple(zip(msg.top_token_ids, msg.top_logprobs)), rank)


def prompt_logprobs_to_proto(prompt: PromptLogprobs) -> common_pb2.PromptLogprobs:
    return common_pb2.PromptLogprobs(
        token_ids=prompt.token_ids,
        positions=[token_logprobs_to_proto(x) for x in prompt.positions],
    )


def prompt_logprobs_from_proto(msg: common_pb2.PromptLogprobs) -> PromptLogprobs:
    if len(msg.positions) != max(0, len(msg.token_ids) - 1):
        raise InvalidRequest(
            f"PromptLogprobs has {len(msg.token_ids)} token_ids but {len(msg.positions)} "
            "positions: a peer must send one per prompt position from 1"
        )
    positions = tuple(token_logprobs_from_proto(x) for x in msg.positions)
    return PromptLogprobs(tuple(msg.token_ids), positions)


def prompt_logprobs_field(msg: Any) -> PromptLogprobs | None:
    """A message's `prompt_logprobs` field (GenerateResponse, DecodeResponse, PrefillResponse),
    None when unset."""
    if not msg.HasField("prompt_logprobs"):
        return None
    return prompt_logprobs_from_proto(msg.prompt_logprobs)


def fill_chunk_proto(msg: Any, chunk: StreamChunk) -> Any:
    """Fill a GenerateResponse or DecodeResponse (same field names) from a StreamChunk."""
    msg.token_ids.extend(chunk.token_ids)
    msg.text = chunk.text
    if chunk.finish_reason is not None:
        msg.finish_reason = FINISH_REASON_TO_PB[chunk.finish_reason]
    if chunk.usage is not None:
        msg.usage.CopyFrom(usage_to_proto(chunk.usage))
    msg.logprobs.extend(token_logprobs_to_proto(x) for x in chunk.logprobs)
    if chunk.prompt_logprobs is not None:
        msg.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(chunk.prompt_logprobs))
    return msg


def chunk_from_proto(msg: Any) -> StreamChunk:
    """Read a GenerateResponse or DecodeResponse into a StreamChunk."""
    if msg.logprobs and len(msg.logprobs) != len(msg.token_ids):
        raise InvalidRequest(
            f"a stream message has {len(msg.token_ids)} token_ids but {len(msg.logprobs)} "
            "logprobs: a peer must send one TokenLogprobs per token id, or none"
        )
    return StreamChunk(
        token_ids=tuple(msg.token_ids),
        text=msg.text,
        finish_reason=finish_reason_from_pb(msg.finish_reason),
        usage=usage_from_proto(msg.usage) if msg.HasField("usage") else None,
        logprobs=tuple(token_logprobs_from_proto(x) for x in msg.logprobs),
        prompt_logprobs=prompt_logprobs_field(msg),
    )


def abort_request_to_proto(request_id: str) -> common_pb2.AbortRequest:
    return common_pb2.AbortRequest(request_id=request_id)


def abort_request_from_proto(msg: common_pb2.AbortRequest) -> str:
    """The id to abort; an empty id is an error (unknown ids are not: Abort answers was_found)."""
    if not msg.request_id:
        raise InvalidRequest("AbortRequest.request_id is empty: name the request to cancel")
    return msg.request_id


def abort_response_to_proto(was_found: bool) -> common_pb2.AbortResponse:
    return common_pb2.AbortResponse(was_found=was_found)


def abort_response_from_proto(msg: common_pb2.AbortResponse) -> bool:
    return msg.was_found
