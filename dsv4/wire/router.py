"""Conversions for the public `dsv4.v1.Router` API (router servicer side and client side)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dsv4.errors import InvalidRequest
from dsv4.rpc.v1 import common_pb2, router_pb2
from dsv4.types import GenerateRequest, ModelInfo, RequestLimits, SamplingParams, StreamChunk
from dsv4.wire.common import chunk_from_proto, fill_chunk_proto, sampling_to_proto
from dsv4.wire.common import sampling_from_proto as _sampling_from_proto
from dsv4.wire.validate import check_prompt_token_ids, check_request_id

Tokenize = Callable[[str], Sequence[int]]


def generate_request_from_proto(
    msg: router_pb2.GenerateRequest,
    limits: RequestLimits,
    *,
    tokenize: Tokenize | None = None,
    deadline_unix_ms: int | None = None,
) -> GenerateRequest:
    """Validate a client's request; text prompts go through `tokenize` (None: ids only).

    An empty request_id is replaced by a random one. Raises InvalidRequest.
    """
    request_id = check_request_id(msg.request_id, limits, may_assign=True)
    which = msg.WhichOneof("input")
    if which is None:
        raise InvalidRequest("GenerateRequest has no input: set prompt or prompt_token_ids")
    if which == "prompt":
        if not msg.prompt:
            raise InvalidRequest("prompt is empty: send non-empty text or prompt_token_ids")
        if tokenize is None:
            raise InvalidRequest(
                "this server has no tokenizer: send prompt_token_ids instead of prompt text"
            )
        ids: Sequence[int] = tokenize(msg.prompt)
    else:
        ids = msg.prompt_token_ids.ids
    prompt = check_prompt_token_ids(ids, limits)
    return GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=_sampling_from_proto(msg.sampling, limits, len(prompt)),
        priority=msg.priority,
        deadline_unix_ms=deadline_unix_ms,
    )


def generate_request_to_proto(
    prompt: str | Sequence[int],
    sampling: SamplingParams | None = None,
    *,
    request_id: str = "",
    priority: int = 0,
) -> router_pb2.GenerateRequest:
    """Client side: text or token ids; `sampling=None` leaves every server default in place."""
    msg = router_pb2.GenerateRequest(request_id=request_id, priority=priority)
    if isinstance(prompt, str):
        msg.prompt = prompt
    else:
        msg.prompt_token_ids.CopyFrom(common_pb2.TokenIds(ids=prompt))
    if sampling is not None:
        msg.sampling.CopyFrom(sampling_to_proto(sampling))
    return msg


def generate_response_to_proto(chunk: StreamChunk) -> router_pb2.GenerateResponse:
    return fill_chunk_proto(router_pb2.GenerateResponse(), chunk)


def generate_response_from_proto(msg: router_pb2.GenerateResponse) -> StreamChunk:
    return chunk_from_proto(msg)


def model_info_request_to_proto() -> router_pb2.GetModelInfoRequest:
    return router_pb2.GetModelInfoRequest()


def model_info_to_proto(info: ModelInfo) -> router_pb2.ModelInfo:
    return router_pb2.ModelInfo(
        model_name=info.model_name,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        max_new_tokens_limit=info.max_new_tokens_limit,
        eos_token_id=info.eos_token_id,
        bos_token_id=info.bos_token_id,
        num_prefill_workers=info.num_prefill_workers,
        num_decode_workers=info.num_decode_workers,
        speculative_method=info.speculative_method,
    )


def model_info_from_proto(msg: router_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(
        model_name=msg.model_name,
        vocab_size=msg.vocab_size,
        max_model_len=msg.max_model_len,
        max_new_tokens_limit=msg.max_new_tokens_limit,
        eos_token_id=msg.eos_token_id,
        bos_token_id=msg.bos_token_id,
        num_prefill_workers=msg.num_prefill_workers,
        num_decode_workers=msg.num_decode_workers,
        speculative_method=msg.speculative_method,
    )
