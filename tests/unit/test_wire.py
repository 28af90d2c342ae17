"""dsv4.wire: dataclass <-> proto round trips, and every validation error says what to fix."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4 import wire
from dsv4.errors import InvalidRequest
from dsv4.rpc.v1 import common_pb2, kv_pb2, router_pb2, worker_pb2
from dsv4.types import (
    DecodeRequest,
    DrainStatus,
    FinishReason,
    GenerateRequest,
    KVHandle,
    KVLayoutInfo,
    ModelInfo,
    PrefillResult,
    PrefillTimings,
    PullFailurePolicy,
    ReleaseRequest,
    ReleaseResult,
    RequestLimits,
    SamplingParams,
    StreamChunk,
    TransportKind,
    Usage,
    WorkerInfo,
    WorkerRole,
)

LIMITS = RequestLimits(vocab_size=1000, max_model_len=64, default_max_new_tokens=16)
SAMPLING = SamplingParams(
    temperature=0.7,
    top_p=0.9,
    top_k=50,
    max_new_tokens=8,
    seed=2**63 + 5,
    stop_token_ids=(1, 2),
    stop_strings=("\n\n", "END"),
    ignore_eos=True,
)
REQUEST = GenerateRequest("req-1", (5, 6, 7), SAMPLING, priority=3, deadline_unix_ms=1_700_000)
LAYOUT = KVLayoutInfo(
    version=2, compat_hash="abc123", block_stride_bytes=1 << 20, block_size_tokens=256
)
HANDLE = KVHandle(
    request_id="req-1",
    prefill_worker_id="prefill-0",
    transport_kind=TransportKind.NIXL,
    transport_endpoint="10.0.0.5:5600",
    block_ids=(4, 9),
    layout_hash="abc123",
    num_tokens=3,
    lease_id="lease-7",
    lease_expires_at_unix_ms=1_700_030_000,
    transport_metadata=b"\x00agent",
    serialized_descriptors=b"\x01descs",
)
USAGE = Usage(
    prompt_tokens=3,
    completion_tokens=8,
    time_to_first_token_ms=12.5,
    prefill_worker_id="prefill-0",
    decode_worker_id="decode-1",
    kv_transfer_bytes=123456,
    kv_transfer_ms=1.5,
    prefill_queue_ms=0.5,
    prefill_compute_ms=9.0,
    num_prefill_retries=1,
    prefill_was_recomputed=True,
    num_draft_tokens=6,
    num_accepted_draft_tokens=4,
)


def _assert_plain(obj: object) -> None:
    """No protobuf container may leak into a dataclass."""
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        assert "google.protobuf" not in type(value).__module__, f.name
        if dataclasses.is_dataclass(value):
            _assert_plain(value)


# ---- round trips ---------------------------------------------------------------------------


def test_tokenized_request_round_trip() -> None:
    back = wire.tokenized_request_from_proto(wire.tokenized_request_to_proto(REQUEST), LIMITS)
    assert back == REQUEST
    _assert_plain(back)
    assert (
        wire.prefill_request_from_proto(wire.prefill_request_to_proto(REQUEST), LIMITS) == REQUEST
    )


def test_generate_request_from_ids_and_text() -> None:
    msg = wire.generate_request_to_proto([5, 6, 7], SAMPLING, request_id="req-1", priority=3)
    assert wire.generate_request_from_proto(msg, LIMITS, deadline_unix_ms=1_700_000) == REQUEST
    text_msg = wire.generate_request_to_proto("hi there", SAMPLING, request_id="req-1")
    got = wire.generate_request_from_proto(text_msg, LIMITS, tokenize=lambda s: [len(s), 1])
    assert got.prompt_token_ids == (8, 1)
    _assert_plain(got)


def test_unset_sampling_takes_defaults_and_clips_max_new_tokens() -> None:
    req = wire.generate_request_from_proto(wire.generate_request_to_proto([1] * 60), LIMITS)
    assert len(req.request_id) == 32  # assigned
    assert req.sampling == SamplingParams(max_new_tokens=4)  # 64 - 60 left, default 16
    assert req.deadline_unix_ms is None


def test_decode_request_round_trip_with_and_without_handle() -> None:
    with_handle = DecodeRequest(REQUEST, 42, HANDLE, PullFailurePolicy.FAIL)
    back = wire.decode_request_from_proto(wire.decode_request_to_proto(with_handle), LIMITS)
    assert back == with_handle and repr(back).count("agent") == 0  # bytes hidden from repr
    _assert_plain(back)
    local = DecodeRequest(REQUEST)
    back = wire.decode_request_from_proto(wire.decode_request_to_proto(local), LIMITS)
    assert back == local and back.needs_local_prefill


def test_prefill_result_and_small_messages_round_trip() -> None:
    result = PrefillResult(42, HANDLE, PrefillTimings(1.0, 2.5, 3), first_token_text="Hi")
    assert wire.prefill_result_from_proto(wire.prefill_result_to_proto(result)) == result
    release = ReleaseRequest("lease-7", "req-1")
    assert wire.release_request_from_proto(wire.release_request_to_proto(release)) == release
    freed = ReleaseResult(True, 2)
    assert wire.release_result_from_proto(wire.release_result_to_proto(freed)) == freed
    drain = DrainStatus(2, 1)
    assert wire.drain_status_from_proto(wire.drain_status_to_proto(drain)) == drain
    assert wire.kv_layout_from_proto(wire.kv_layout_to_proto(LAYOUT)) == LAYOUT
    assert wire.abort_request_from_proto(wire.abort_request_to_proto("req-1")) == "req-1"
    assert wire.abort_response_from_proto(wire.abort_response_to_proto(True)) is True


@pytest.mark.parametrize(
    ("to_proto", "from_proto"),
    [
        (wire.generate_response_to_proto, wire.generate_response_from_proto),
        (wire.decode_response_to_proto, wire.decode_response_from_proto),
    ],
)
def test_stream_chunks_round_trip(to_proto, from_proto) -> None:
    middle = StreamChunk(token_ids=(3, 4), text="ab")
    last = StreamChunk(token_ids=(5,), text="c", finish_reason=FinishReason.STOP, usage=USAGE)
    for chunk in (middle, last, StreamChunk(finish_reason=FinishReason.ABORT)):
        back = from_proto(to_proto(chunk))
        assert back == chunk
        _assert_plain(back)
    assert not middle.is_last and last.is_last


def test_worker_info_and_model_info_round_trip() -> None:
    info = WorkerInfo(
        "decode-1", WorkerRole.DECODE, "10.0.0.6:50061", TransportKind.CUDA_IPC, "ipc:0",
        LAYOUT, 100, 200, 5000, 7, 0, True, "tiny", 1000, 64, 1_700_000_000_000,
    )  # fmt: skip
    assert wire.worker_info_from_proto(wire.worker_info_to_proto(info)) == info
    assert wire.decode_worker_info(wire.encode_worker_info(info)) == info
    no_layout = dataclasses.replace(info, layout=None)
    assert wire.worker_info_from_proto(wire.worker_info_to_proto(no_layout)) == no_layout
    model = ModelInfo("tiny", 1000, 64, 64, 1, 0, 2, 3, "mtp")
    assert wire.model_info_from_proto(wire.model_info_to_proto(model)) == model


# ---- validation -------------------------------------------------------------------------------


def _gen(**sampling: object) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        request_id="r", prompt_token_ids=common_pb2.TokenIds(ids=[1, 2, 3]),
        sampling=common_pb2.SamplingParams(**sampling),
    )  # fmt: skip


BAD_GENERATE = {
    "no input": (router_pb2.GenerateRequest(request_id="r"), "set prompt or prompt_token_ids"),
    "empty text": (router_pb2.GenerateRequest(prompt=""), "prompt is empty"),
    "empty ids": (
        router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds()),
        "prompt is empty",
    ),
    "text without tokenizer": (router_pb2.GenerateRequest(prompt="hi"), "send prompt_token_ids"),
    "negative id": (wire.generate_request_to_proto([1, -1]), r"prompt_token_ids\[1\] = -1"),
    "id >= vocab": (wire.generate_request_to_proto([1000]), r"must be in \[0, 1000\)"),
    "prompt too long": (wire.generate_request_to_proto([1] * 64), "at most 63 tokens"),
    "bad id chars": (router_pb2.GenerateRequest(request_id="a b", prompt="x"), "request_id"),
    "long id": (router_pb2.GenerateRequest(request_id="a" * 129, prompt="x"), "at most 128"),
    "temperature < 0": (_gen(temperature=-0.1), "temperature = -0.1: use 0 for greedy"),
    "temperature nan": (_gen(temperature=math.nan), "temperature = nan"),
    "temperature inf": (_gen(temperature=math.inf), "temperature = inf"),
    "top_p 0": (_gen(top_p=0.0), r"top_p = 0.0: must be in \(0, 1\]"),
    "top_p > 1": (_gen(top_p=1.5), "top_p = 1.5"),
    "top_p nan": (_gen(top_p=math.nan), "top_p = nan"),
    "top_k < 0": (_gen(top_k=-1), "top_k = -1: must be 0"),
    "top_k > vocab": (_gen(top_k=1001), "top_k = 1001"),
    "max_new_tokens 0": (_gen(max_new_tokens=0), "max_new_tokens = 0: must be at least 1"),
    "max_new_tokens > room": (_gen(max_new_tokens=62), "at most 61 new tokens fit"),
    "too many stops": (_gen(stop=["x"] * 17), "at most 16"),
    "empty stop": (_gen(stop=["ok", ""]), r"stop\[1\] is empty"),
    "long stop": (_gen(stop=["x" * 257]), "at most 256"),
    "too many stop ids": (_gen(stop_token_ids=[1] * 65), "at most 64"),
    "stop id >= vocab": (_gen(stop_token_ids=[5, 1000]), r"stop_token_ids\[1\] = 1000"),
}


@pytest.mark.parametrize("case", sorted(BAD_GENERATE))
def test_generate_request_errors_say_what_to_fix(case: str) -> None:
    msg, pattern = BAD_GENERATE[case]
    with pytest.raises(InvalidRequest, match=pattern):
        wire.generate_request_from_proto(msg, LIMITS)


def test_max_new_tokens_above_the_server_limit() -> None:
    limits = dataclasses.replace(LIMITS, max_new_tokens_limit=10)
    with pytest.raises(InvalidRequest, match="allows at most 10"):
        wire.generate_request_from_proto(_gen(max_new_tokens=11), limits)


def _decode(**changes: object) -> worker_pb2.DecodeRequest:
    msg = wire.decode_request_to_proto(DecodeRequest(REQUEST, 42, HANDLE))
    for path, value in changes.items():
        target = msg.handle if path.startswith("handle_") else msg
        name = path.removeprefix("handle_")
        if isinstance(value, list):
            target.ClearField(name)
            getattr(target, name).extend(value)
        else:
            setattr(target, name, value)
    return msg


BAD_DECODE = {
    "first token without handle": (_decode(first_token_id=3), "together with handle"),
    "first token out of vocab": (_decode(first_token_id=1000), "first_token_id"),
    "handle of another request": (_decode(handle_request_id="req-2"), "belongs to request"),
    "handle token count": (_decode(handle_num_tokens=4), "holds KV of 4 tokens"),
    "handle without lease": (_decode(handle_lease_id=""), "lease_id is empty"),
    "handle without blocks": (_decode(handle_block_ids=[]), "at least one token"),
    "unspecified transport": (_decode(handle_transport_kind=0), "transport_kind = 0"),
    "unknown transport": (_decode(handle_transport_kind=9), "newer API"),
    "unspecified policy": (_decode(pull_failure_policy=0), "pull_failure_policy = 0"),
    "handle without request id": (_decode(handle_request_id=""), "request_id is empty"),
}


@pytest.mark.parametrize("case", sorted(BAD_DECODE))
def test_decode_request_errors_say_what_to_fix(case: str) -> None:
    msg, pattern = BAD_DECODE[case]
    if case == "first token without handle":
        msg.ClearField("handle")
    with pytest.raises(InvalidRequest, match=pattern):
        wire.decode_request_from_proto(msg, LIMITS)


def test_internal_requests_need_the_routers_id() -> None:
    msg = wire.tokenized_request_to_proto(dataclasses.replace(REQUEST, request_id=""))
    with pytest.raises(InvalidRequest, match="request_id is empty"):
        wire.tokenized_request_from_proto(msg, LIMITS)


def test_other_boundary_errors() -> None:
    with pytest.raises(InvalidRequest, match="lease_id is empty"):
        wire.release_request_from_proto(worker_pb2.ReleaseRequest())
    with pytest.raises(InvalidRequest, match="no handle"):
        wire.prefill_result_from_proto(worker_pb2.PrefillResponse(first_token_id=1))
    with pytest.raises(InvalidRequest, match="does not parse"):
        wire.decode_worker_info(b"\xff\xff\xff")
    with pytest.raises(InvalidRequest, match="worker_id and address"):
        wire.worker_info_from_proto(worker_pb2.WorkerInfo(role=1))
    with pytest.raises(InvalidRequest, match="request_id is empty"):
        wire.abort_request_from_proto(common_pb2.AbortRequest())
    assert kv_pb2.TRANSPORT_KIND_UNSPECIFIED == 0


# ---- fuzzing: hostile input gives InvalidRequest or a valid request, nothing else ------------

int32s = st.integers(-(2**31), 2**31 - 1)
floats = st.floats(allow_nan=True, allow_infinity=True, width=64)


@st.composite
def generate_requests(draw: st.DrawFn) -> router_pb2.GenerateRequest:
    msg = router_pb2.GenerateRequest(request_id=draw(st.text(max_size=140)), priority=draw(int32s))
    if draw(st.booleans()):
        msg.prompt = draw(st.text(max_size=80))
    elif draw(st.booleans()):
        msg.prompt_token_ids.ids.extend(draw(st.lists(st.integers(-5, 1100), max_size=70)))
    s = msg.sampling
    for name in ("temperature", "top_p"):
        if draw(st.booleans()):
            setattr(s, name, draw(floats))
    s.top_k = draw(st.integers(-3, 1003))
    if draw(st.booleans()):
        s.max_new_tokens = draw(st.integers(-3, 80))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    s.stop_token_ids.extend(draw(st.lists(st.integers(-2, 1002), max_size=66)))
    s.stop.extend(draw(st.lists(st.text(max_size=260), max_size=17)))
    s.ignore_eos = draw(st.booleans())
    s.logit_bias.update(draw(st.dictionaries(st.integers(-3, 1003), floats, max_size=4)))
    if draw(st.booleans()):
        s.logprobs = draw(st.integers(-3, 25))
    if draw(st.booleans()):
        s.prompt_logprobs = draw(st.integers(-3, 25))
    return msg


@settings(max_examples=100, deadline=None, database=None)
@given(generate_requests())
def test_fuzzed_generate_requests_never_crash(msg: router_pb2.GenerateRequest) -> None:
    try:
        req = wire.generate_request_from_proto(msg, LIMITS, tokenize=lambda s: [ord(c) for c in s])
    except InvalidRequest as exc:
        assert exc.message
        return
    assert 0 < req.num_prompt_tokens < LIMITS.max_model_len
    assert 1 <= req.sampling.max_new_tokens <= LIMITS.max_model_len - req.num_prompt_tokens
    assert req.sampling.temperature >= 0 and 0 < req.sampling.top_p <= 1
    assert all(0 <= t < LIMITS.vocab_size and -100 <= b <= 100 for t, b in req.sampling.logit_bias)
    assert req.sampling.logprobs is None or 0 <= req.sampling.logprobs <= LIMITS.max_logprobs
    n = req.sampling.prompt_logprobs
    assert n is None or 0 <= n <= LIMITS.max_logprobs
    back = wire.tokenized_request_from_proto(wire.tokenized_request_to_proto(req), LIMITS)
    assert back == req
