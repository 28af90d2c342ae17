"""The router's vLLM-named request metrics as an OpenAI client drives them through the HTTP front
(a real front on a loopback port, scripted workers): `vllm:prompt_tokens_total` counts each
prompt of a request once, whatever `n` (as vLLM does, and as the answer's usage does), and
`vllm:generation_tokens_total` every choice's tokens; `vllm:request_success_total` counts
finished calls by `finished_reason`, a client that left mid-stream as `abort`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from dsv4.serving.metrics import FINISHED_REASONS
from dsv4.serving.ports import free_port
from router_svc.server import RouterServer
from tests.router_fakes.harness import ScriptedCluster, scripted_cluster
from tests.router_fakes.scripted_workers import (
    ScriptedDecodeWorker,
    ScriptedPrefillWorker,
    WorkerScript,
)
from tests.services.test_router_http_input import post, run

CHAT = [{"role": "user", "content": "hello there"}]


@asynccontextmanager
async def front(decode: WorkerScript | None = None) -> AsyncIterator[tuple[ScriptedCluster, str]]:
    """A router with its HTTP front on a free loopback port: (cluster, ".../v1")."""
    port = free_port()
    async with scripted_cluster(
        [ScriptedPrefillWorker("p0")], [ScriptedDecodeWorker("d0", decode)],
        router__http_port=port,
    ) as c:  # fmt: skip
        yield c, f"http://127.0.0.1:{port}/v1"


def _counts(server: RouterServer) -> dict[str, float]:
    """Token counters and request_success by reason (summed over model_name)."""
    out = {"prompt": 0.0, "generation": 0.0, **dict.fromkeys(FINISHED_REASONS, 0.0)}
    for family in server.registry.collect():
        for sample in family.samples:
            if sample.name == "vllm:prompt_tokens_total":
                out["prompt"] += sample.value
            elif sample.name == "vllm:generation_tokens_total":
                out["generation"] += sample.value
            elif sample.name == "vllm:request_success_total":
                out[sample.labels["finished_reason"]] += sample.value
    return out


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


async def _streamed_usage(url: str, body: dict[str, Any]) -> dict[str, int]:
    """The usage chunk of a streamed request (include_usage)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            text = line.decode().strip()
            if text.startswith("data: {") and (event := json.loads(text[6:])).get("usage"):
                usage = event["usage"]
    assert usage is not None
    return usage


def test_prompt_tokens_count_each_prompt_once_whatever_n() -> None:
    """With n = 3 each choice is its own call: prompt_tokens_total used to grow by 3 x the
    prompt while the answer's usage said 1 x."""

    async def body() -> None:
        async with front() as (c, url):
            cases = [
                ("/completions", {"prompt": "hello world, how", "max_tokens": 3, "n": 3}),
                ("/completions", {"prompt": ["a b c", "d e"], "max_tokens": 2, "n": 2}),
                ("/chat/completions", {"messages": CHAT, "max_tokens": 2, "n": 2}),
                ("/completions", {"prompt": "one choice", "max_tokens": 4}),
            ]
            for path, request in cases:
                before = _counts(c.server)
                status, answer = await post(url + path, request)
                assert status == 200, answer
                usage, num_choices = answer["usage"], len(answer["choices"])
                grew = _delta(before, _counts(c.server))
                assert grew == {
                    "prompt": usage["prompt_tokens"],
                    "generation": usage["completion_tokens"],
                    "length": num_choices,
                }, (path, request, usage, grew)
            before = _counts(c.server)
            usage = await _streamed_usage(
                url + "/chat/completions", {"messages": CHAT, "max_tokens": 3, "n": 3}
            )
            grew = _delta(before, _counts(c.server))
            assert grew["prompt"] == usage["prompt_tokens"], (usage, grew)
            assert grew["generation"] == usage["completion_tokens"], (usage, grew)

    run(body())


def test_a_client_that_leaves_mid_stream_counts_as_abort() -> None:
    async def body() -> None:
        async with front(WorkerScript(token_delay_s=0.05)) as (c, url):
            before = _counts(c.server)
            request = {"prompt": "hi", "max_tokens": 500, "stream": True}
            async with (
                aiohttp.ClientSession() as session,
                session.post(url + "/completions", json=request) as r,
            ):
                assert r.status == 200
                await r.content.readline()  # the first event: the call is running
            give_up_s = time.monotonic() + 10
            while _counts(c.server)["abort"] == before["abort"]:
                assert time.monotonic() < give_up_s, "the abandoned call was never counted"
                await asyncio.sleep(0.05)
            grew = _delta(before, _counts(c.server))
            assert grew.get("abort") == 1 and "length" not in grew, grew
            status, _ = await post(url + "/completions", {"prompt": "hi", "max_tokens": 2})
            assert status == 200

    run(body())
