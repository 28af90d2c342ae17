"""Fuzzing the public API of a real cluster (router + P + D processes) with hypothesis: random
and hostile GenerateRequest / Abort / GetModelInfo messages (huge ids, negative and extreme
numbers, NaN and infinite floats, giant and many stop strings, long repeated fields, raw bytes
that are not a message, invalid UTF-8 in string fields, empty messages). Only proper status
codes come back (never UNKNOWN or INTERNAL), and afterwards a normal request succeeds, no
service died and no worker holds a block. Example counts are bounded (~20-40 s of fuzzing)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from e2e_cluster import assert_no_worker_leaks, generate, greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4.cluster import free_port
from dsv4.rpc.v1 import common_pb2, router_pb2
from tests.services.worker_cluster import PROMPTS, start_cluster, tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
CALL_TIMEOUT_S = 3.0
PROPER = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
FUZZ = settings(
    deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip
INT32 = st.integers(-(2**31), 2**31 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 1e-320, 1e308])
TEXT = st.text(max_size=40) | st.sampled_from(["", "x" * 5000, "\u0000\ud7ff\U0010ffff" * 20])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    model_dir = tiny_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache")
    cluster = start_cluster(model_dir, router_port=free_port())
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def channel(cluster):
    with grpc.insecure_channel(cluster.router_address) as channel:
        yield channel


@st.composite
def sampling_params(draw) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        top_k=draw(INT32 | st.integers(-2, 5)),
        stop_token_ids=draw(st.lists(INT32, max_size=8) | st.just([7] * 5000)),
        stop=draw(st.lists(TEXT, max_size=4) | st.just(["ab"] * 1000)),
        ignore_eos=draw(st.booleans()),
    )
    for name, strategy in (
        ("temperature", FLOATS),
        ("top_p", FLOATS),
        ("max_new_tokens", st.integers(-3, 6) | st.sampled_from([-(2**31), 2**31 - 1])),
        ("seed", st.integers(0, 2**64 - 1)),
    ):
        if draw(st.booleans()):
            setattr(msg, name, draw(strategy))
    return msg


@st.composite
def generate_requests(draw) -> router_pb2.GenerateRequest:
    msg = router_pb2.GenerateRequest(
        request_id=draw(TEXT | st.sampled_from(["ok-id", "a" * 129, "a" * 100_000])),
        priority=draw(INT32),
    )
    which = draw(st.sampled_from(["ids", "text", "none"]))
    if which == "ids":
        ids = draw(st.lists(INT32 | st.integers(0, 999), max_size=20) | st.just([5] * 10_000))
        msg.prompt_token_ids.ids.extend(ids)
    elif which == "text":
        msg.prompt = draw(TEXT)
    if draw(st.booleans()):
        msg.sampling.CopyFrom(draw(sampling_params()))
    return msg


def status_of(call) -> grpc.StatusCode:
    try:
        for _ in call:
            pass
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_generate_with_hostile_fields_gets_proper_codes(channel) -> None:
    generate_call = channel.unary_stream(
        "/dsv4.v1.Router/Generate",
        request_serializer=router_pb2.GenerateRequest.SerializeToString,
        response_deserializer=router_pb2.GenerateResponse.FromString,
    )

    @settings(FUZZ, max_examples=120)
    @given(generate_requests())
    def check(msg: router_pb2.GenerateRequest) -> None:
        code = status_of(generate_call(msg, timeout=CALL_TIMEOUT_S))
        assert code in PROPER, (code, msg)

    check()


def _raw(channel, method: str, stream: bool):
    make = channel.unary_stream if stream else channel.unary_unary
    return make(f"/dsv4.v1.Router/{method}", request_serializer=bytes, response_deserializer=bytes)


def invalid_utf8_in(field_number: int) -> st.SearchStrategy[bytes]:
    bad = st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"ok\xf0\x28\x8c\x28"])
    return bad.map(lambda b: bytes([field_number << 3 | 2, len(b)]) + b)


def test_raw_bytes_and_invalid_utf8_are_invalid_argument_on_every_method(channel) -> None:
    calls = {
        "Generate": _raw(channel, "Generate", stream=True),
        "Abort": _raw(channel, "Abort", stream=False),
        "GetModelInfo": _raw(channel, "GetModelInfo", stream=False),
    }
    payloads = st.binary(max_size=64) | invalid_utf8_in(1) | invalid_utf8_in(2)

    @settings(FUZZ, max_examples=80)
    @given(st.sampled_from(sorted(calls)), payloads)
    def check(method: str, payload: bytes) -> None:
        call = calls[method]
        if method == "Generate":
            code = status_of(call(payload, timeout=CALL_TIMEOUT_S))
        else:
            try:
                call(payload, timeout=CALL_TIMEOUT_S)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
        assert code in {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}, (method, payload)

    check()


def test_abort_with_hostile_ids_gets_proper_codes(channel) -> None:
    abort = channel.unary_unary(
        "/dsv4.v1.Router/Abort",
        request_serializer=common_pb2.AbortRequest.SerializeToString,
        response_deserializer=common_pb2.AbortResponse.FromString,
    )

    @settings(FUZZ, max_examples=40)
    @given(TEXT | st.sampled_from(["a" * 1_000_000, "ok-id\nforged log line"]))
    def check(request_id: str) -> None:
        try:
            abort(common_pb2.AbortRequest(request_id=request_id), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT, exc

    check()


def test_the_service_is_up_and_leak_free_after_fuzzing(cluster) -> None:
    """Runs last."""

    async def body() -> None:
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            outcome = await generate(channel, PROMPTS[0], greedy(4))
        assert outcome.code is grpc.StatusCode.OK and len(outcome.token_ids) == 4
        await assert_no_worker_leaks(cluster, timeout_s=15.0)

    asyncio.run(asyncio.wait_for(body(), 60))
    assert not cluster.dead_services()
