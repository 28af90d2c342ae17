"""Bad input at the router's OpenAI-compatible HTTP front (router_svc/http), on a real front on a
loopback port in front of scripted workers: each gets a 4xx with a one-line OpenAI error object,
never a 500, a traceback in the log or a connection held open, and the front keeps serving.

Deep nesting and integers beyond Python's digit limit are 400s naming the body; a request of
more choices than the router admits at once (each choice is admitted as one request) is a 400
naming the limit, not a 429 no retry ends; a body shorter than its Content-Length gets 408;
GET /v1/models/{id} answers the openai client's `models.retrieve`; chat content parts and
template options are type-checked, and `stop: ""` is refused as over gRPC; a clamped integer's
refusal echoes the value sent."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import tracemalloc
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import openai
import pytest

from dsv4.serving.ports import free_port
from router_svc.http.body import check_unicode
from router_svc.http.errors import ApiError
from tests.router_fakes.harness import ScriptedCluster, scripted_cluster
from tests.router_fakes.scripted_workers import ScriptedDecodeWorker, ScriptedPrefillWorker

CHAT = [{"role": "user", "content": "hi"}]


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = 30.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@asynccontextmanager
async def front(**config: Any) -> AsyncIterator[tuple[ScriptedCluster, str]]:
    """A router with its HTTP front on a free loopback port: (cluster, ".../v1")."""
    port = free_port()
    async with scripted_cluster(
        [ScriptedPrefillWorker("p0")], [ScriptedDecodeWorker("d0")], router__http_port=port,
        **config,
    ) as c:  # fmt: skip
        yield c, f"http://127.0.0.1:{port}/v1"


async def post(url: str, body: bytes | dict[str, Any], **headers: str) -> tuple[int, Any]:
    """(status, parsed JSON) of a POST."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **headers}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=data, headers=headers) as r,
    ):
        return r.status, await r.json(content_type=None)


def refused(status: int, answer: Any, param: str) -> str:
    """The message of a 400 naming `param`; asserts it is one."""
    assert status == 400 and answer["error"]["param"] == param, (status, answer)
    message = answer["error"]["message"]
    assert "\n" not in message and "Traceback" not in message, message
    return message


def no_errors_logged(caplog: pytest.LogCaptureFixture) -> None:
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_deep_nesting_is_a_400_without_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with front() as (_, url):
            for depth, status in ((900, 200), (2000, 400), (100_000, 400)):
                raw = '{"prompt": "hi", "max_tokens": 2, "x": ' + "[" * depth + "]" * depth + "}"
                answer = await post(url + "/completions", raw.encode())
                assert answer[0] == status, (depth, answer)
                if status == 400:
                    assert "nested too deeply" in refused(*answer, "body")
            assert (await post(url + "/completions", {"prompt": "hi", "max_tokens": 2}))[0] == 200

    with caplog.at_level(logging.ERROR):
        run(body())
    no_errors_logged(caplog)


def test_huge_integers_and_unknown_charsets_are_plain_400s(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body() -> None:
        async with front() as (_, url):
            raw = '{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}"
            message = refused(*await post(url + "/completions", raw.encode()), "body")
            assert "too large" in message and "sys." not in message
            answer = await post(url + "/completions", b'{"prompt": "hi"}',
                                **{"Content-Type": "application/json; charset=bogus"})  # fmt: skip
            assert "bogus" in refused(*answer, "body")  # was a 500 (LookupError)

    with caplog.at_level(logging.ERROR):
        run(body())
    no_errors_logged(caplog)


def test_the_surrogate_walk_holds_memory_by_depth_not_by_paths() -> None:
    """A wide list deep down: the walk used to spell every element's path (GBs at 16 MB)."""
    deep: Any = list(range(100_000))
    for _ in range(400):
        deep = [deep]
    tracemalloc.start()
    try:
        check_unicode({"x": deep, "prompt": "ok"})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5_000_000, peak
    with pytest.raises(ApiError) as caught:
        check_unicode({"messages": [{"role": "user", "content": "a\ud800"}]})
    assert caught.value.param == "messages"
    assert caught.value.message.startswith("messages[0].content holds a lone UTF-16 surrogate")


@pytest.mark.parametrize(
    ("limits", "name"),
    [({"router__rate_limit_rps": 0.5, "router__rate_limit_burst": 2}, "router.rate_limit_burst"),
     ({"router__max_inflight_requests": 2}, "router.max_inflight_requests")],
)  # fmt: skip
def test_more_choices_than_the_router_admits_at_once_is_a_400_naming_the_limit(
    limits: dict[str, Any], name: str
) -> None:
    async def body() -> None:
        async with front(**limits) as (_, url):
            for extra in ({"n": 8}, {"prompt": ["a", "b"], "n": 2}):
                answer = await post(
                    url + "/completions", {"prompt": "hi", "max_tokens": 2, **extra}
                )
                message = refused(*answer, "n")
                assert name in message and "at most 2" in message, message
            status, answer = await post(
                url + "/completions", {"prompt": "hi", "n": 2, "max_tokens": 2}
            )
            assert status == 200 and len(answer["choices"]) == 2, answer

    run(body())


def test_a_refused_request_of_several_choices_takes_no_share_of_the_rate_limit() -> None:
    """Each choice used to take its token on its own: the first ones took the last tokens, a
    later one was refused, and a client retrying after Retry-After never got n at once."""

    async def body() -> None:
        async with front(router__rate_limit_rps=0.01, router__rate_limit_burst=2) as (_, url):
            one = {"prompt": "hi", "max_tokens": 2}
            assert (await post(url + "/completions", one))[0] == 200  # one token left
            status, answer = await post(url + "/completions", {**one, "n": 2})
            assert status == 429 and "rate limit" in answer["error"]["message"], answer
            assert (await post(url + "/completions", one))[0] == 200  # the token is still there

    run(body())


def test_a_body_shorter_than_its_content_length_gets_408_and_the_front_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The connection is closed after aiohttp's lingering read of the rest (10 s at most)."""

    async def body() -> None:
        async with front() as (c, url):
            assert c.server.http is not None
            c.server.http.body_timeout_s = 0.5
            reader, writer = await asyncio.open_connection("127.0.0.1", c.server.http.port)
            try:
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n"
                             b'Content-Type: application/json\r\n\r\n{"prompt":')  # fmt: skip
                started = time.monotonic()
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
                assert time.monotonic() - started < 5.0
                assert head.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in head, head
            finally:
                writer.close()
            assert (await post(url + "/completions", {"prompt": "hi", "max_tokens": 2}))[0] == 200

    with caplog.at_level(logging.ERROR):
        run(body())
    no_errors_logged(caplog)


def test_models_retrieve_answers_the_served_model_and_404_for_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def body() -> None:
        async with front() as (c, url):
            served = c.server.servicer.model_info()
            named = dataclasses.replace(served, model_name="/ckpt/deepseek-ai/DeepSeek-V4")
            monkeypatch.setattr(c.server.servicer, "model_info", lambda: named)

            def retrieve() -> None:
                with openai.OpenAI(base_url=url, api_key="-", max_retries=0) as client:
                    listed = client.models.list().data[0]
                    assert client.models.retrieve(named.model_name) == listed
                    assert listed.id == named.model_name
                    with pytest.raises(openai.NotFoundError) as caught:
                        client.models.retrieve("deepseek-ai/other")
                    error = caught.value.body
                    assert error["code"] == "model_not_found" and error["param"] == "model"

            await asyncio.to_thread(retrieve)

    run(body())


def test_chat_parts_template_options_and_empty_stop_are_type_checked() -> None:
    async def body() -> None:
        async with front() as (c, url):
            chat = url + "/chat/completions"
            for extra, param, says in (
                ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
                 "messages", "messages[0].content[0].text = 5"),
                ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
                 "messages", "messages[0].content[0] is a text part without text"),
                ({"chat_template_kwargs": "x"}, "chat_template_kwargs", "must be an object"),
                ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "messages"),
                ({"add_generation_prompt": "x"}, "add_generation_prompt", "true or false"),
                ({"stop": ""}, "stop", "stop[0] is empty"),
                ({"stop": ["x", ""]}, "stop", "stop[1] is empty"),
            ):  # fmt: skip
                answer = await post(chat, {"messages": CHAT, "max_tokens": 2, **extra})
                assert says in refused(*answer, param), (extra, answer)
            status, _ = await post(url + "/completions", {"prompt": "hi", "stop": ""})
            assert status == 400  # /v1/completions too, as the gRPC API
            options = {"chat_template_kwargs": {"thinking": False}, "add_generation_prompt": False}
            for extra in ({}, options):
                status, answer = await post(chat, {"messages": CHAT, "max_tokens": 2, **extra})
                assert status == 200, answer
            opened, closed = (r.prompt_token_ids for r in c.prefills[0].log.requests)
            assert closed == opened[: len(closed)] and len(closed) < len(opened)  # no answer turn

    run(body())


def test_clamped_integers_are_refused_with_the_value_sent() -> None:
    async def body() -> None:
        async with front() as (_, url):
            for name, param in (("max_tokens", "max_tokens"), ("max_completion_tokens",
                                "max_tokens"), ("top_k", "top_k"), ("logprobs", "logprobs"),
                                ("prompt_logprobs", "prompt_logprobs")):  # fmt: skip
                for sent in (10**12, -(10**12)):
                    answer = await post(url + "/completions", {"prompt": "hi", name: sent})
                    assert refused(*answer, param).startswith(f"{param} = {sent}:"), answer

    run(body())


def test_vllm_parameters_that_change_the_answer_are_refused_not_ignored() -> None:
    """min_tokens, min_p, guided decoding, a request's chat_template... were dropped without a
    word, so a vLLM client got an answer to a request it did not send; off values still pass."""

    async def body() -> None:
        async with front() as (_, url):
            for path, extra, param in (
                ("/completions", {"min_tokens": 5}, "min_tokens"),
                ("/completions", {"min_p": 0.1}, "min_p"),
                ("/completions", {"include_stop_str_in_output": True},
                 "include_stop_str_in_output"),
                ("/completions", {"guided_choice": ["a", "b"]}, "guided_choice"),
                ("/completions", {"skip_special_tokens": False}, "skip_special_tokens"),
                ("/completions", {"use_beam_search": True}, "use_beam_search"),
                ("/completions", {"stream": True, "stream_options":
                                  {"continuous_usage_stats": True}}, "stream_options"),
                ("/chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
                ("/chat/completions", {"continue_final_message": True},
                 "continue_final_message"),
                ("/chat/completions", {"tool_choice": "required"}, "tool_choice"),
            ):  # fmt: skip
                request = {"messages": CHAT} if path.startswith("/chat") else {"prompt": "hi"}
                answer = await post(url + path, {**request, "max_tokens": 2, **extra})
                assert "not supported" in refused(*answer, param), (extra, answer)
            off = {"min_tokens": 0, "min_p": 0.0, "skip_special_tokens": True,
                   "include_stop_str_in_output": False, "tool_choice": "none"}  # fmt: skip
            status, answer = await post(url + "/completions", {"prompt": "hi", "max_tokens": 2,
                                                               **off})  # fmt: skip
            assert status == 200, answer

    run(body())


def test_vllm_priority_reaches_the_workers_lower_first() -> None:
    """vLLM's `priority` (lower is served first) was dropped; the gRPC field is larger first."""

    async def body() -> None:
        async with front() as (c, url):
            for priority in (-3, 0, 7, 10**12):
                status, answer = await post(
                    url + "/completions", {"prompt": "hi", "max_tokens": 2, "priority": priority}
                )
                assert status == 200, answer
            sent = [r.priority for r in c.prefills[0].log.requests]
            assert sent == [3, 0, -7, -(2**31 - 1)], sent
            answer = await post(url + "/completions", {"prompt": "hi", "priority": "high"})
            assert "must be an integer" in refused(*answer, "priority")

    run(body())


def test_an_unparseable_request_is_one_warning_line_not_an_error_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A header line over aiohttp's limit or a control character in one: aiohttp answers 400,
    and used to log an ERROR with a traceback, so any client could fill the router's log."""

    async def body() -> None:
        async with front() as (c, url):
            assert c.server.http is not None
            for head in (b"X-Request-Id: " + b"a" * 10_000, b"X-Request-Id: bad\x01id"):
                reader, writer = await asyncio.open_connection("127.0.0.1", c.server.http.port)
                try:
                    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n" + head +
                                 b"\r\nContent-Length: 2\r\n\r\n{}")  # fmt: skip
                    answer = await asyncio.wait_for(reader.read(), 10.0)
                    assert answer.split(b" ")[1] == b"400", answer[:200]
                finally:
                    writer.close()
            assert (await post(url + "/completions", {"prompt": "hi", "max_tokens": 2}))[0] == 200

    with caplog.at_level(logging.WARNING):
        run(body())
    no_errors_logged(caplog)
    warned = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(warned) == 2 and all(r.exc_info is None for r in warned), caplog.text
    assert all("\n" not in r.getMessage() and "400" in r.getMessage() for r in warned)
