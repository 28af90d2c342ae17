"""Fuzzing the public API of a real cluster (router + P + D processes) with hypothesis: random
and hostile GenerateRequest / Abort / GetModelInfo messages (huge ids, negative and extreme
numbers, floats such as 1e-300, 1e-45, 5e-324, inf and NaN in every sampling field, huge ints,
priorities, giant and many stop strings, long repeated fields, a 16 MB text prompt, raw bytes
that are not a message, invalid UTF-8 in string fields, empty messages). Half the Generate
examples are otherwise valid, so extreme sampling values reach the engines. Only proper status
codes or a valid stream come back (never UNKNOWN or INTERNAL), a normal request succeeds right
after every Generate example (one bad request must not wedge a worker), and at the end no
service died and no worker holds a block. Derandomized, bounded example counts: ~30 s in all."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from e2e_cluster import assert_no_worker_leaks, generate, greedy
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dsv4.commands.cluster import free_port
from dsv4.rpc.v1 import common_pb2, router_pb2
from tests.services.worker_cluster import PROMPTS, start_cluster, tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
CALL_TIMEOUT_S = 3.0
VOCAB_SIZE = 1024  # the tiny checkpoint's
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
EXTREME_FLOATS = st.sampled_from([
    1e-300, 1e-45, 1e-30, 5e-324, 1e-320, 1e-38, 1e-5, 1e-3, 0.0, -0.0, -1.0, -1e-300, 1e308,
    3.4e38, math.inf, -math.inf, math.nan, 0.5, 0.999, 1.0, 1.0000001, 2.0, 1e6,
])  # fmt: skip
FLOATS = EXTREME_FLOATS | st.floats(allow_nan=True, allow_infinity=True)
UNIT_FLOATS = EXTREME_FLOATS.filter(lambda x: 0 < x <= 1) | st.floats(1e-320, 1.0)
TEXT = st.text(max_size=40) | st.sampled_from(["", "x" * 5000, "\u0000\ud7ff\U0010ffff" * 20])
IDS = st.integers(0, VOCAB_SIZE - 1)
NORMAL = router_pb2.GenerateRequest(
    prompt_token_ids=common_pb2.TokenIds(ids=PROMPTS[0]),
    sampling=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True),
)


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
def sampling_params(draw, is_valid: bool) -> common_pb2.SamplingParams:
    """Anything (`is_valid=False`), or values that pass validation, extremes included."""
    if is_valid:
        msg = common_pb2.SamplingParams(
            top_k=draw(st.integers(0, 3) | st.sampled_from([VOCAB_SIZE - 1, VOCAB_SIZE])),
            stop_token_ids=draw(st.lists(IDS, max_size=4)),
            stop=draw(st.lists(st.text(min_size=1, max_size=8), max_size=4)),
            ignore_eos=draw(st.booleans()),
            max_new_tokens=draw(st.integers(1, 4)),
        )
        temperatures = EXTREME_FLOATS.filter(lambda x: x >= 0 and math.isfinite(x))
        strategies = (("temperature", temperatures), ("top_p", UNIT_FLOATS))
    else:
        msg = common_pb2.SamplingParams(
            top_k=draw(INT32 | st.integers(-2, 5)),
            stop_token_ids=draw(st.lists(INT32, max_size=8) | st.just([7] * 5000)),
            stop=draw(st.lists(TEXT, max_size=4) | st.just(["ab"] * 1000)),
            ignore_eos=draw(st.booleans()),
            # Small counts keep generation short; the extremes are refused before any work.
            max_new_tokens=draw(st.integers(-3, 4) | st.sampled_from([-(2**31), 2**31 - 1])),
        )
        strategies = (("temperature", FLOATS), ("top_p", FLOATS))
    for name, strategy in (*strategies, ("seed", st.integers(0, 2**64 - 1))):
        if draw(st.booleans()):
            setattr(msg, name, draw(strategy))
    return msg


@st.composite
def generate_requests(draw) -> router_pb2.GenerateRequest:
    is_valid = draw(st.booleans())
    if is_valid:
        request_id = draw(st.sampled_from(["", "fuzz-1", "a:b/c=d+e@f.g"]))
    else:
        request_id = draw(TEXT | st.sampled_from(["ok-id", "a" * 129, "a" * 100_000]))
    msg = router_pb2.GenerateRequest(
        request_id=request_id, priority=draw(INT32 | st.sampled_from([-(2**31), 2**31 - 1]))
    )
    which = draw(st.sampled_from(["ids", "text"] if is_valid else ["ids", "text", "none"]))
    if which == "ids":
        hostile = st.lists(INT32 | IDS, max_size=20) | st.just([5] * 10_000)
        ids = draw(st.lists(IDS, min_size=1, max_size=20) if is_valid else hostile)
        msg.prompt_token_ids.ids.extend(ids)
    elif which == "text":
        hostile = TEXT | st.just("The quick brown fox " * 800_000)  # 16 MB
        msg.prompt = draw(st.text(min_size=1, max_size=60) if is_valid else hostile)
    msg.sampling.CopyFrom(draw(sampling_params(is_valid)))
    return msg


def _issue_example(**sampling: float) -> router_pb2.GenerateRequest:
    """The reproductions of defect 1: sampling values that filter out every token."""
    return router_pb2.GenerateRequest(
        prompt_token_ids=common_pb2.TokenIds(ids=[5, 9, 200, 17, 33]),
        sampling=common_pb2.SamplingParams(max_new_tokens=4, **sampling),
    )


def status_of(call) -> grpc.StatusCode:
    try:
        for _ in call:
            pass
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_generate_fuzz_then_a_normal_request_succeeds(channel) -> None:
    generate_call = channel.unary_stream(
        "/dsv4.v1.Router/Generate",
        request_serializer=router_pb2.GenerateRequest.SerializeToString,
        response_deserializer=router_pb2.GenerateResponse.FromString,
    )

    @settings(FUZZ, max_examples=150)
    @given(generate_requests())
    @example(_issue_example(temperature=1.0, top_p=1e-300))
    @example(_issue_example(temperature=1e-30))
    @example(_issue_example(temperature=1.0, top_p=1e-45, top_k=1))
    @example(_issue_example(temperature=1e-300, top_p=5e-324))
    def check(msg: router_pb2.GenerateRequest) -> None:
        code = status_of(generate_call(msg, timeout=CALL_TIMEOUT_S))
        assert code in PROPER, (code, msg.sampling, msg.priority)
        replies = list(generate_call(NORMAL, timeout=10.0))
        assert sum(len(r.token_ids) for r in replies) == 2, (msg.sampling, replies)
        assert replies[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH

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

    @settings(FUZZ, max_examples=150)
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
