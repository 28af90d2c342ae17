"""The router's API boundary against scripted peers (tests.router_fakes.scripted_workers): bounded work before a
request is validated (a 16 MB prompt is refused at once, long prompts are tokenized off the
event loop), sampling no sampler can evaluate reaches workers as greedy, Abort only for the
key that made the request, and ModelInfo from what the workers report."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import grpc

from dsv4.rpc.v1 import common_pb2, router_pb2
from tests.router_fakes.harness import (
    generate_request,
    read_outcome,
    scripted_cluster,
    tiny_text_model,
)
from tests.router_fakes.scripted_workers import (
    ScriptedDecodeWorker,
    ScriptedPrefillWorker,
    WorkerScript,
)

PROMPT = [5, 9, 200, 17, 33]


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = 10.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def pair(**d_script: Any) -> tuple[list[ScriptedPrefillWorker], list[ScriptedDecodeWorker]]:
    return [ScriptedPrefillWorker("p0")], [ScriptedDecodeWorker("d0", WorkerScript(**d_script))]


def test_a_16_mb_prompt_is_refused_within_a_second_and_others_are_served() -> None:
    async def body() -> None:
        async with scripted_cluster(*pair(max_model_len=4096)) as c:
            huge = generate_request(2, "The quick brown fox " * 800_000)  # 16 MB of text
            started = time.monotonic()
            calls = [c.stub.Generate(huge) for _ in range(4)]
            normal = c.stub.Generate(generate_request(2, PROMPT))
            results = await asyncio.gather(*(read_outcome(call) for call in calls))
            assert all(code == grpc.StatusCode.INVALID_ARGUMENT for code, _, _ in results)
            assert "16000000 bytes" in results[0][1] and "max_model_len = 4096" in results[0][1]
            assert (await read_outcome(normal))[0] == grpc.StatusCode.OK
            assert time.monotonic() - started < 2.0  # four of them, on a loaded 2-core box

    run(body(), timeout_s=30.0)


def test_a_long_text_prompt_is_tokenized_in_the_pool_and_served() -> None:
    async def body() -> None:
        async with scripted_cluster(*pair()) as c:
            text = "Readability counts. " * 200  # 4000 characters: not inline
            code, _, messages = await read_outcome(c.stub.Generate(generate_request(2, text)))
            assert code == grpc.StatusCode.OK
            expected = tiny_text_model().codec.encode(text)
            assert c.prefills[0].log.requests[0].prompt_token_ids == tuple(expected)
            assert messages[-1].usage.prompt_tokens == len(expected)
            assert c.server.tokenizer_pool.num_admitted == 0

    run(body())


def test_degenerate_sampling_is_refused_or_reaches_the_workers_as_greedy() -> None:
    """Values that cannot yield a token in fp32 (the issue's reproductions) are refused by the
    shared validation; values that can, but only ever pick the top token, go out as greedy."""

    async def body() -> None:
        async with scripted_cluster(*pair()) as c:
            for sampling in ({"top_p": 1e-300}, {"temperature": 1e-30}, {"top_p": 1e-45}):
                request = generate_request(3, PROMPT, **{"temperature": 1.0, **sampling})
                code, details, _ = await read_outcome(c.stub.Generate(request))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, details
                assert "sampling." in details
            for sampling in ({"top_p": 1e-9}, {"temperature": 5e-6}):
                request = generate_request(4, PROMPT, **{"temperature": 1.0, **sampling})
                code, _, _ = await read_outcome(c.stub.Generate(request))
                assert code == grpc.StatusCode.OK
                seen = c.prefills[0].log.requests[-1].sampling
                assert (seen.temperature, seen.top_p, seen.top_k) == (0.0, 1.0, 0)

    run(body())


def test_only_the_key_that_made_a_request_may_abort_it() -> None:
    async def body() -> None:
        keys = {"router__api_keys": ("alice-key", "bob-key")}
        alice = (("authorization", "Bearer alice-key"),)
        bob = (("authorization", "Bearer bob-key"),)
        async with scripted_cluster(*pair(token_delay_s=0.05), **keys) as c:
            call = c.stub.Generate(generate_request(40, PROMPT, request_id="a1"), metadata=alice)
            await call.read()
            abort = common_pb2.AbortRequest(request_id="a1")
            stolen = await c.stub.Abort(abort, metadata=bob)
            unknown = await c.stub.Abort(common_pb2.AbortRequest(request_id="zz"), metadata=bob)
            assert stolen == unknown and not stolen.was_found  # the answer of an unknown id
            assert (await c.stub.Abort(abort, metadata=alice)).was_found
            code, _, messages = await read_outcome(call)
            assert code == grpc.StatusCode.OK
            assert messages[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        async with scripted_cluster(*pair(token_delay_s=0.05)) as c:  # no keys: anyone may
            call = c.stub.Generate(generate_request(40, PROMPT, request_id="a2"))
            await call.read()
            assert (await c.stub.Abort(common_pb2.AbortRequest(request_id="a2"))).was_found
            call.cancel()

    run(body())


def test_model_info_reports_what_the_decode_workers_run() -> None:
    async def body() -> None:
        prefills = [ScriptedPrefillWorker("p0", WorkerScript(speculative_method="none"))]
        decodes = [ScriptedDecodeWorker("d0", WorkerScript(speculative_method="mtp"))]
        # The router's own flag says "none": the workers' Info wins.
        async with scripted_cluster(prefills, decodes, speculative__method="none") as c:
            info = await c.stub.GetModelInfo(router_pb2.GetModelInfoRequest())
            assert info.speculative_method == "mtp" and info.model_name == "scripted"
        mixed = [ScriptedDecodeWorker(f"d{i}", WorkerScript(speculative_method=m))
                 for i, m in enumerate(("mtp", "none"))]  # fmt: skip
        async with scripted_cluster([ScriptedPrefillWorker("p0")], mixed) as c:
            info = await c.stub.GetModelInfo(router_pb2.GetModelInfoRequest())
            assert info.speculative_method == "mtp,none"  # a rollout in progress says so

    run(body())
