"""The router's CONTROL FLOW against scripted peers (tests.router_fakes.scripted_workers), not real workers.

Every test starts in-process grpc.aio PrefillWorker / DecodeWorker servicers with tiny
deterministic behaviour (P answers a first token and a handle, D streams the rest; variants
fail with UNAVAILABLE, hang, or close the stream early) and a real RouterServer in front of
them. They check routing, retries, failure propagation, cancellation, migration and usage.
End-to-end tests with real engine processes and real NIXL transfers live elsewhere.
All loops are bounded, every server is stopped, each test takes well under 10 s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import grpc

from dsv4.rpc.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.router_fakes.harness import generate_request, scripted_cluster, tiny_text_model
from tests.router_fakes.scripted_workers import (
    ScriptedDecodeWorker,
    ScriptedPrefillWorker,
    WorkerScript,
    next_token,
)

VOCAB = 1000
PROMPT = list(range(10, 26))  # 16 tokens
TEXT = tiny_text_model(VOCAB)


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = 8.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def expected_tokens(prompt: Sequence[int], n: int) -> list[int]:
    return [next_token(len(prompt) + i, VOCAB) for i in range(n)]


def cluster(*args: Any, **kw: Any) -> Any:
    return scripted_cluster(*args, **kw)


def gen_request(n: int = 5, prompt: Sequence[int] | str = PROMPT, **kw: Any) -> Any:
    return generate_request(n, prompt, **kw)


async def collect(
    stub: router_pb2_grpc.RouterStub, request: router_pb2.GenerateRequest, **kw: Any
) -> list[router_pb2.GenerateResponse]:
    return [msg async for msg in stub.Generate(request, **kw)]


def tokens_of(messages: Sequence[router_pb2.GenerateResponse]) -> list[int]:
    return [t for m in messages for t in m.token_ids]


async def status_of(coro: Coroutine[Any, Any, Any]) -> tuple[grpc.StatusCode, str]:
    try:
        await coro
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


async def eventually(predicate: Any, timeout_s: float = 3.0) -> None:
    """Poll until `predicate()` holds: cancels, aborts and lease releases reach the scripted
    peers asynchronously (a loaded 2-core CI box can take well over 50 ms)."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s"
        await asyncio.sleep(0.02)


# ---- the happy path ---------------------------------------------------------------------------


def test_disaggregated_stream_text_and_usage() -> None:
    async def body() -> None:
        async with cluster([ScriptedPrefillWorker("p0")], [ScriptedDecodeWorker("d0")]) as c:
            messages = await collect(c.stub, gen_request(6))
            assert tokens_of(messages) == expected_tokens(PROMPT, 6)
            assert "".join(m.text for m in messages) == TEXT.codec.decode(
                expected_tokens(PROMPT, 6)
            )
            last = messages[-1]
            assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
            u = last.usage
            assert (u.prompt_tokens, u.completion_tokens) == (len(PROMPT), 6)
            assert (u.prefill_worker_id, u.decode_worker_id) == ("p0", "d0")
            assert u.kv_transfer_bytes == 4096 and u.time_to_first_token_ms > 0
            decode = c.decodes[0].log.requests[0]
            assert decode.first_token_id == expected_tokens(PROMPT, 1)[0]
            assert decode.handle.lease_id == f"lease-{decode.request.request_id}"

    run(body())


def test_first_token_is_streamed_before_decode_answers() -> None:
    async def body() -> None:
        slow_d = ScriptedDecodeWorker("d0", WorkerScript(delay_s=0.6))
        async with cluster([ScriptedPrefillWorker("p0")], [slow_d]) as c:
            started = time.monotonic()
            call = c.stub.Generate(gen_request(3))
            first = await call.read()
            first_s = time.monotonic() - started
            rest = []
            while (msg := await call.read()) is not grpc.aio.EOF:
                rest.append(msg)
            assert first.token_ids == expected_tokens(PROMPT, 1) and first_s < 0.4
            assert tokens_of([first, *rest]) == expected_tokens(PROMPT, 3)
            assert rest[-1].usage.time_to_first_token_ms < 400

    run(body())


def test_text_prompt_and_colocated_worker_without_prefill_pool() -> None:
    async def body() -> None:
        engine = ScriptedDecodeWorker("c0", colocated=True)
        async with cluster([], [engine]) as c:
            text = "The quick brown fox"
            prompt_ids = TEXT.codec.encode(text)
            messages = await collect(c.stub, gen_request(4, prompt=text))
            assert tokens_of(messages) == expected_tokens(prompt_ids, 4)
            decode = engine.log.requests[0]
            assert decode.handle is None and decode.first_token_id is None
            assert messages[-1].usage.prefill_worker_id == ""
            info = await c.stub.GetModelInfo(router_pb2.GetModelInfoRequest())
            assert (info.vocab_size, info.num_prefill_workers, info.num_decode_workers) == (
                VOCAB,
                0,
                1,
            )

    run(body())


def test_router_enforces_stop_strings_and_aborts_decode() -> None:
    async def body() -> None:
        full = TEXT.codec.decode(expected_tokens(PROMPT, 12))
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        async with cluster([ScriptedPrefillWorker("p0")], [ScriptedDecodeWorker("d0")]) as c:
            messages = await collect(c.stub, gen_request(12, stop=[stop]))
            text = "".join(m.text for m in messages)
            assert text == full[: full.index(stop)]
            assert messages[-1].finish_reason == common_pb2.FINISH_REASON_STOP
            assert len(tokens_of(messages)) < 12
            rid = c.decodes[0].log.requests[0].request.request_id
            await eventually(lambda: c.decodes[0].log.aborted == [rid])

    run(body())


# ---- prefill failures: retry on another P -----------------------------------------------------


def _two_prefills(first: WorkerScript) -> list[ScriptedPrefillWorker]:
    """p0 is preferred (fewer queued tokens) and scripted to misbehave; p1 works."""
    return [
        ScriptedPrefillWorker("p0", first),
        ScriptedPrefillWorker("p1", WorkerScript(num_queued_tokens=50)),
    ]


def test_prefill_unavailable_is_retried_on_another_prefill_worker() -> None:
    async def body() -> None:
        prefills = _two_prefills(WorkerScript(fail_code=grpc.StatusCode.UNAVAILABLE))
        async with cluster(prefills, [ScriptedDecodeWorker("d0")]) as c:
            messages = await collect(c.stub, gen_request(4))
            assert tokens_of(messages) == expected_tokens(PROMPT, 4)
            usage = messages[-1].usage
            assert (usage.prefill_worker_id, usage.num_prefill_retries) == ("p1", 1)

    run(body())


def test_prefill_worker_killed_before_answering_is_retried() -> None:
    async def body() -> None:
        prefills = _two_prefills(WorkerScript(delay_s=30.0))
        async with cluster(prefills, [ScriptedDecodeWorker("d0")]) as c:
            call = c.stub.Generate(gen_request(3))
            await asyncio.sleep(0.2)  # the Prefill is running on p0
            await c.prefills[0].stop()  # p0 dies without answering
            messages = [m async for m in call]
            assert tokens_of(messages) == expected_tokens(PROMPT, 3)
            assert messages[-1].usage.prefill_worker_id == "p1"

    run(body())


def test_hung_prefill_times_out_is_cancelled_and_retried() -> None:
    async def body() -> None:
        prefills = _two_prefills(WorkerScript(delay_s=30.0))
        settings = {"router__prefill_timeout_s": 0.3}
        async with cluster(prefills, [ScriptedDecodeWorker("d0")], **settings) as c:
            started = time.monotonic()
            messages = await collect(c.stub, gen_request(3))
            assert time.monotonic() - started < 2.0
            assert messages[-1].usage.prefill_worker_id == "p1"
            rid = c.prefills[0].log.requests[0].request_id
            await eventually(lambda: c.prefills[0].log.cancelled == [rid])

    run(body())


def test_every_prefill_failing_ends_with_unavailable() -> None:
    async def body() -> None:
        down = WorkerScript(fail_code=grpc.StatusCode.UNAVAILABLE)
        prefills = [ScriptedPrefillWorker(f"p{i}", down) for i in range(2)]
        async with cluster(
            prefills, [ScriptedDecodeWorker("d0")], router__max_prefill_retries=1
        ) as c:
            code, details = await status_of(collect(c.stub, gen_request(3)))
            assert code == grpc.StatusCode.UNAVAILABLE and "prefill failed on 2 workers" in details

    run(body())


# ---- decode failures --------------------------------------------------------------------------


def _lease_ids(prefill: ScriptedPrefillWorker) -> list[str]:
    return [f"lease-{r.request_id}" for r in prefill.log.requests]


def test_decode_dying_mid_stream_gives_unavailable_fast_and_releases_the_lease() -> None:
    async def body() -> None:
        d0 = ScriptedDecodeWorker("d0", WorkerScript(fail_after=2))
        async with cluster([ScriptedPrefillWorker("p0")], [d0]) as c:
            started = time.monotonic()
            code, details = await status_of(collect(c.stub, gen_request(8)))
            assert code == grpc.StatusCode.UNAVAILABLE and "after 3 tokens" in details
            assert time.monotonic() - started < 2.0
            await eventually(lambda: c.prefills[0].log.released == _lease_ids(c.prefills[0]))

    run(body())


def test_decode_closing_its_stream_early_gives_unavailable() -> None:
    async def body() -> None:
        d0 = ScriptedDecodeWorker("d0", WorkerScript(close_after=2))
        async with cluster([ScriptedPrefillWorker("p0")], [d0]) as c:
            code, details = await status_of(collect(c.stub, gen_request(8)))
            assert code == grpc.StatusCode.UNAVAILABLE and "closed its stream" in details

    run(body())


def test_decode_that_stops_answering_is_detected_by_probes() -> None:
    async def body() -> None:
        d0 = ScriptedDecodeWorker("d0", WorkerScript(hang_after=1))
        async with cluster([ScriptedPrefillWorker("p0")], [d0]) as c:
            call = c.stub.Generate(gen_request(8))
            assert len((await call.read()).token_ids) == 1
            d0.script.info_mode = "hang"  # the process is frozen: no tokens, no Info
            started = time.monotonic()
            code, details = await status_of(collect_rest(call))
            assert code == grpc.StatusCode.UNAVAILABLE and "probes in a row" in details
            # ~0.5 s expected (2 probes of 0.2 s); the bound only has to rule out the call's own
            # deadline, and a loaded 2-core CI box has taken over 3 s.
            assert time.monotonic() - started < 6.0
            rid = d0.log.requests[0].request.request_id
            await eventually(lambda: d0.log.cancelled == [rid])

    run(body())


async def collect_rest(call: Any) -> list[Any]:
    rest = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        rest.append(msg)
    return rest


def test_decode_unreachable_before_streaming_is_replaced_with_the_same_handle() -> None:
    async def body() -> None:
        broken = ScriptedDecodeWorker(
            "d0", WorkerScript(num_free_blocks=500, fail_code=grpc.StatusCode.UNAVAILABLE)
        )
        async with cluster(
            [ScriptedPrefillWorker("p0")], [broken, ScriptedDecodeWorker("d1")]
        ) as c:
            messages = await collect(c.stub, gen_request(4))
            assert tokens_of(messages) == expected_tokens(PROMPT, 4)
            assert messages[-1].usage.decode_worker_id == "d1"
            assert c.decodes[1].log.requests[0].handle == broken.log.requests[0].handle

    run(body())


def test_lease_is_released_when_decode_is_never_reached() -> None:
    async def body() -> None:
        broken = ScriptedDecodeWorker("d0", WorkerScript(fail_code=grpc.StatusCode.UNAVAILABLE))
        async with cluster([ScriptedPrefillWorker("p0")], [broken]) as c:
            code, _ = await status_of(collect(c.stub, gen_request(4)))
            assert code == grpc.StatusCode.UNAVAILABLE
            await eventually(lambda: c.prefills[0].log.released == _lease_ids(c.prefills[0]))

    run(body())


def test_migration_continues_the_stream_on_another_pair() -> None:
    async def body() -> None:
        d0 = ScriptedDecodeWorker("d0", WorkerScript(num_free_blocks=500, fail_after=3))
        decodes = [d0, ScriptedDecodeWorker("d1")]
        settings = {"router__migrate_on_decode_failure": True}
        async with cluster([ScriptedPrefillWorker("p0")], decodes, **settings) as c:
            messages = await collect(c.stub, gen_request(10, request_id="mig"))
            assert tokens_of(messages) == expected_tokens(PROMPT, 10)
            assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert messages[-1].usage.decode_worker_id == "d1"
            resumed = c.decodes[1].log.requests[0].request
            assert resumed.request_id == "mig.m1"
            assert resumed.prompt_token_ids == (*PROMPT, *expected_tokens(PROMPT, 4))
            assert resumed.sampling.max_new_tokens == 6

    run(body())


# ---- cancellation, Abort, deadlines -----------------------------------------------------------


def test_client_cancel_reaches_decode_and_prefill() -> None:
    async def body() -> None:
        d0 = ScriptedDecodeWorker("d0", WorkerScript(token_delay_s=0.2))
        async with cluster([ScriptedPrefillWorker("p0")], [d0]) as c:
            call = c.stub.Generate(gen_request(20, request_id="gone"))
            await call.read()
            await call.read()
            call.cancel()
            await eventually(lambda: d0.log.aborted == ["gone"] and d0.log.cancelled == ["gone"])
            await eventually(lambda: c.prefills[0].log.released == ["lease-gone"])

    run(body())


def test_client_cancel_during_prefill_cancels_the_prefill_call() -> None:
    async def body() -> None:
        p0 = ScriptedPrefillWorker("p0", WorkerScript(delay_s=30.0))
        async with cluster([p0], [ScriptedDecodeWorker("d0")]) as c:
            call = c.stub.Generate(gen_request(5, request_id="early"))
            await asyncio.sleep(0.2)
            call.cancel()
            await eventually(lambda: p0.log.cancelled == ["early"])
            assert c.decodes[0].log.requests == []

    run(body())


def test_router_abort_ends_the_stream_with_finish_reason_abort() -> None:
    async def body() -> None:
        d0 = ScriptedDecodeWorker("d0", WorkerScript(token_delay_s=0.1))
        async with cluster([ScriptedPrefillWorker("p0")], [d0]) as c:
            call = c.stub.Generate(gen_request(50, request_id="stop-me"))
            await call.read()
            found = await c.stub.Abort(common_pb2.AbortRequest(request_id="stop-me"))
            rest = await collect_rest(call)
            assert found.was_found and rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
            assert rest[-1].usage.completion_tokens == 1 + len(tokens_of(rest))
            unknown = await c.stub.Abort(common_pb2.AbortRequest(request_id="nope"))
            assert not unknown.was_found
            await eventually(lambda: d0.log.aborted == ["stop-me"])

    run(body())


def test_client_deadline_bounds_the_request() -> None:
    async def body() -> None:
        d0 = ScriptedDecodeWorker("d0", WorkerScript(token_delay_s=0.2))
        async with cluster([ScriptedPrefillWorker("p0")], [d0]) as c:
            sent_at_ms = time.time() * 1000
            code, _ = await status_of(collect(c.stub, gen_request(50), timeout=0.5))
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED
            deadline_ms = c.prefills[0].log.requests[0].deadline_unix_ms
            assert sent_at_ms < deadline_ms <= sent_at_ms + 600
            await eventually(lambda: bool(d0.log.cancelled))
            # counted as its deadline, not as a client that went away: gRPC cancels the handler
            # at the deadline as it does for a client that left, and that used to win the race
            # with the router's own deadline most of the time
            for _ in range(2):
                await status_of(collect(c.stub, gen_request(50), timeout=0.3))

            def ended() -> dict[str, float | None]:
                return {code: c.server.registry.get_sample_value(
                    "dsv4_router_requests_total", {"method": "Generate", "code": code})
                    for code in ("DEADLINE_EXCEEDED", "CANCELLED")}  # fmt: skip

            await eventually(lambda: sum(v or 0 for v in ended().values()) == 3)
            assert ended() == {"DEADLINE_EXCEEDED": 3.0, "CANCELLED": None}, ended()

    run(body())


def test_decode_process_killed_mid_stream_gives_unavailable_fast() -> None:
    async def body() -> None:
        d0 = ScriptedDecodeWorker("d0", WorkerScript(token_delay_s=0.1))
        async with cluster([ScriptedPrefillWorker("p0")], [d0]) as c:
            call = c.stub.Generate(gen_request(30))
            await call.read()
            await call.read()
            started = time.monotonic()
            await d0.stop()
            code, _ = await status_of(collect_rest(call))
            assert code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 2.0

    run(body())


def test_a_full_decode_pool_is_waited_for_while_the_lease_lasts() -> None:
    """The only D refuses 3 hand-offs as full, then has room: the request waits (P's lease
    has 30 s left) and gets every token, instead of failing after its first token."""

    async def body() -> None:
        full_thrice = WorkerScript(fail_code=grpc.StatusCode.RESOURCE_EXHAUSTED, fail_calls=3)
        prefill = ScriptedPrefillWorker("p0", WorkerScript(lease_ttl_s=30.0))
        async with cluster([prefill], [ScriptedDecodeWorker("d0", full_thrice)]) as c:
            messages = await collect(c.stub, gen_request(5))
            assert tokens_of(messages) == expected_tokens(PROMPT, 5)
            assert len(c.decodes[0].log.requests) == 4
            retries = c.server.registry.get_sample_value("dsv4_router_decode_full_retries_total")
            assert retries == 3
            assert c.prefills[0].log.released == []  # D finished: the lease was D's to free

    run(body())


def test_the_wait_for_decode_room_ends_before_the_lease_would() -> None:
    """A lease with 1.2 s left and a 1 s pull timeout: the router gives up ~0.2 s after the
    first refusal with RESOURCE_EXHAUSTED, P's lease released; `decode_full_wait_s` 0 gives
    up at once even with a long lease."""

    async def body(lease_ttl_s: float, **config: Any) -> tuple[float, int]:
        full = WorkerScript(fail_code=grpc.StatusCode.RESOURCE_EXHAUSTED)
        prefill = ScriptedPrefillWorker("p0", WorkerScript(lease_ttl_s=lease_ttl_s))
        async with cluster([prefill], [ScriptedDecodeWorker("d0", full)], **config) as c:
            start = time.monotonic()
            code, details = await status_of(collect(c.stub, gen_request(4)))
            took_s = time.monotonic() - start
            assert (
                code == grpc.StatusCode.RESOURCE_EXHAUSTED
                and "no decode worker has room" in details
            )
            await eventually(lambda: c.prefills[0].log.released == _lease_ids(c.prefills[0]))
            return took_s, len(c.decodes[0].log.requests)

    took_s, calls = run(body(1.2, transfer__pull_timeout_s=1.0, transfer__lease_ttl_s=2.0))
    assert 0.1 <= took_s < 1.2 and calls >= 2, (took_s, calls)
    took_s, calls = run(body(30.0, router__decode_full_wait_s=0.0))
    assert took_s < 1.0 and calls == 1, (took_s, calls)


def test_every_decode_worker_full_is_resource_exhausted_with_a_retry_hint() -> None:
    """Overload, not an outage: the client may retry (seen under `make soak` at 5 req/s)."""

    async def body() -> None:
        full = WorkerScript(fail_code=grpc.StatusCode.RESOURCE_EXHAUSTED)
        decodes = [ScriptedDecodeWorker("d0", full), ScriptedDecodeWorker("d1", full)]
        async with cluster([ScriptedPrefillWorker("p0")], decodes) as c:
            call = c.stub.Generate(gen_request(4))
            with_first = [await call.read()]  # P's first token was streamed already
            try:
                while (msg := await call.read()) is not grpc.aio.EOF:
                    with_first.append(msg)
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), exc.details()
                trailers = dict(exc.trailing_metadata())
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
            assert "no decode worker has room" in details
            assert trailers["grpc-retry-pushback-ms"] == "1000"
            assert all(len(d.log.requests) == 1 for d in decodes)
            await eventually(lambda: c.prefills[0].log.released == _lease_ids(c.prefills[0]))

    run(body())
