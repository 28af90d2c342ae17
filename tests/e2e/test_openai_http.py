"""The OpenAI-compatible HTTP front, driven by the official `openai` client against a real
cluster (router with --http-port + P + D processes): chat and text completions, streamed and
whole, equal the gRPC answer for the same prompt; the model is listed; bad input, missing API
key, rate limit, no worker and deadline get OpenAI error objects with their HTTP status; a
client that disconnects mid-stream gets its request aborted and its blocks freed on the
workers. Each cluster test ends with the leak check over every worker's Info."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import grpc
import openai
import pytest
from e2e_cluster import (
    ExtraRouter,
    assert_logprobs_close,
    assert_no_worker_leaks,
    generate,
    greedy,
    routed_logprobs,
    worker_leaks,
)

from dsv4.commands.cluster import free_port
from dsv4.config import ModelSection
from dsv4.serving.metrics import scrape
from router_svc.http import load_chat_template
from router_svc.text_model import load_text_model
from tests.services.worker_cluster import (
    single_engine_outputs,
    single_engine_runs,
    start_cluster,
    tiny_checkpoint,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
MAX_TOKENS = 8
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "The quick brown fox jumps over the lazy dog"},
]
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return tiny_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache")


@pytest.fixture(scope="module")
def cluster(model_dir):
    cluster = start_cluster(model_dir, router_port=free_port(), http_port=free_port())
    yield cluster
    cluster.stop()


@pytest.fixture
def client(cluster):
    with openai.OpenAI(base_url=cluster.http_url, api_key="unused", max_retries=0) as client:
        yield client
    asyncio.run(assert_no_worker_leaks(cluster))


def served_model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def grpc_text(cluster, prompt: str) -> tuple[str, int]:
    async def run() -> tuple[str, int]:
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            outcome = await generate(channel, prompt, greedy(MAX_TOKENS))
        assert outcome.code is grpc.StatusCode.OK, outcome.details
        return outcome.text, outcome.chunks[-1].usage.prompt_tokens

    return asyncio.run(run())


def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any], Any]:
    """(status, headers, body: parsed JSON or text) of a GET, errors included."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {})) as r:
            status, head, raw = r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as exc:
        status, head, raw = exc.code, dict(exc.headers), exc.read().decode()
    try:
        return status, head, json.loads(raw)
    except ValueError:
        return status, head, raw


def http_post(url: str, data: bytes) -> tuple[int, Any]:
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_models_health_and_metrics(cluster, client) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [str(cluster.spec.model_dir)]
    assert models[0].model_extra["vocab_size"] > 0  # what `dsv4 loadtest --backend openai` reads
    assert http_get(cluster.http_url.removesuffix("/v1") + "/health")[0] == 200
    status, _, text = http_get(cluster.http_url.removesuffix("/v1") + "/metrics")
    assert status == 200 and "vllm:num_requests_running" in text


def test_chat_completion_streamed_and_whole_equal_the_grpc_answer(cluster, client) -> None:
    model = served_model(client)
    whole = client.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, stream=True, stream_options={"include_usage": True},
        **GREEDY,
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert whole.choices[0].finish_reason == "length"
    assert whole.choices[0].message.role == "assistant"
    assert streamed == whole.choices[0].message.content
    # The chat template rendered the prompt; gRPC with that prompt text answers the same.
    section = ModelSection(path=str(cluster.spec.model_dir))
    prompt = load_chat_template(section, load_text_model(section)).render(MESSAGES)
    text, num_prompt_tokens = grpc_text(cluster, prompt)
    assert streamed == text
    assert whole.usage.prompt_tokens == num_prompt_tokens
    assert whole.usage.completion_tokens == MAX_TOKENS
    assert whole.usage.total_tokens == num_prompt_tokens + MAX_TOKENS


def test_completion_streamed_and_whole_equal_the_grpc_answer(cluster, client) -> None:
    model, prompt = served_model(client), "Readability counts."
    whole = client.completions.create(model=model, prompt=prompt, **GREEDY)
    chunks = list(client.completions.create(model=model, prompt=prompt, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk
    text, num_prompt_tokens = grpc_text(cluster, prompt)
    assert whole.choices[0].text == text
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
        num_prompt_tokens, MAX_TOKENS,
    )  # fmt: skip
    # A stop string cuts the text before it and ends the request with "stop".
    stop = text.strip()[2:5]
    assert stop, text
    cut = client.completions.create(model=model, prompt=prompt, stop=[stop], **GREEDY)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_n_choices_whole_and_streamed(cluster, client) -> None:
    """n = 3: three choices by index. Greedy ones all equal the gRPC answer; seeded sampled
    ones reproduce choice by choice (seed + i each) and the stream interleaves the same texts
    with one usage chunk counting the prompt once."""
    model, prompt = served_model(client), "Readability counts."
    text, num_prompt_tokens = grpc_text(cluster, prompt)
    greedy3 = client.completions.create(model=model, prompt=prompt, n=3, **GREEDY)
    assert [c.index for c in greedy3.choices] == [0, 1, 2]
    assert [c.text for c in greedy3.choices] == [text] * 3
    assert (greedy3.usage.prompt_tokens, greedy3.usage.completion_tokens) == (
        num_prompt_tokens, 3 * MAX_TOKENS,
    )  # fmt: skip
    sampled = {"temperature": 1.0, "seed": 7, "max_tokens": MAX_TOKENS, "n": 3,
               "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = client.completions.create(model=model, prompt=prompt, **sampled)
    again = client.completions.create(model=model, prompt=prompt, **sampled)
    texts = [c.text for c in whole.choices]
    assert texts == [c.text for c in again.choices] and len(set(texts)) > 1, texts
    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, stream=True, stream_options={"include_usage": True},
        **sampled,
    ))  # fmt: skip
    chat_whole = client.chat.completions.create(model=model, messages=MESSAGES, **sampled)
    streamed = {i: "" for i in range(3)}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        streamed[choice.index] += choice.delta.content or ""
    assert [streamed[i] for i in range(3)] == [c.message.content for c in chat_whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage == chat_whole.usage
    assert chat_whole.usage.completion_tokens == 3 * MAX_TOKENS


def test_a_batch_of_prompts_answers_each_in_order(cluster, client) -> None:
    """prompt = [p0, p1] with n = 2: choices 0-1 answer p0 and 2-3 answer p1, each the gRPC
    answer for its prompt (greedy), whole and streamed; usage counts each prompt once."""
    model, prompts = served_model(client), ["Readability counts.", "Flat is better than nested."]
    answers = [grpc_text(cluster, p) for p in prompts]
    whole = client.completions.create(model=model, prompt=prompts, n=2, **GREEDY)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert [c.text for c in whole.choices] == [answers[0][0]] * 2 + [answers[1][0]] * 2
    assert whole.usage.prompt_tokens == answers[0][1] + answers[1][1]
    assert whole.usage.completion_tokens == 4 * MAX_TOKENS
    streamed = ["", "", "", ""]
    for chunk in client.completions.create(model=model, prompt=prompts, n=2, stream=True,
                                           **GREEDY):  # fmt: skip
        (choice,) = chunk.choices
        streamed[choice.index] += choice.text
    assert streamed == [c.text for c in whole.choices]


def test_penalties_through_prefill_and_decode_equal_the_single_engine(
    cluster, client, model_dir
) -> None:
    """Penalties cross the hand-off: P samples the first token with them, D goes on with the
    first token in the history. The router's tokens equal one engine's; HTTP gives the same
    text; the penalties changed the continuation."""
    penalties = {"presence_penalty": -1.5, "frequency_penalty": -0.4, "repetition_penalty": 0.5}
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 9]

    async def routed() -> tuple[list[int], str]:
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            outcome = await generate(channel, prompt, greedy(MAX_TOKENS, **penalties))
        assert outcome.code is grpc.StatusCode.OK, outcome.details
        return [t for c in outcome.chunks for t in c.token_ids], outcome.text

    tokens, text = asyncio.run(routed())
    (expected,) = single_engine_outputs(model_dir, [prompt], MAX_TOKENS, sampling=penalties)
    assert tokens == expected
    assert single_engine_outputs(model_dir, [prompt], MAX_TOKENS)[0] != expected
    extra = {"ignore_eos": True, "repetition_penalty": 0.5}
    http = client.completions.create(
        model=served_model(client), prompt=prompt, temperature=0.0, max_tokens=MAX_TOKENS,
        presence_penalty=-1.5, frequency_penalty=-0.4, extra_body=extra,
    )  # fmt: skip
    assert http.choices[0].text == text


def test_logit_bias_through_prefill_and_decode(cluster, client) -> None:
    """+100 on a token: P samples the first token with it, D every later one (gRPC); -100 on
    every token of the plain answer bans them all; `logit_bias` over HTTP (string keys, as the
    OpenAI client sends them) gives the gRPC text, on both endpoints."""
    forced, prompt = 500, [5, 6, 7, 5, 6, 7, 9]  # 500: "ten" (the tokenizer has 748 tokens)

    async def routed(**more: object) -> tuple[list[int], str]:
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            outcome = await generate(channel, prompt, greedy(MAX_TOKENS, **more))
        assert outcome.code is grpc.StatusCode.OK, outcome.details
        return [t for c in outcome.chunks for t in c.token_ids], outcome.text

    tokens, text = asyncio.run(routed(logit_bias=((forced, 100.0),)))
    assert tokens == [forced] * MAX_TOKENS and text == "ten" * MAX_TOKENS
    plain, _ = asyncio.run(routed())
    banned, _ = asyncio.run(routed(logit_bias=tuple((t, -100.0) for t in sorted(set(plain)))))
    assert len(banned) == MAX_TOKENS and not set(banned) & set(plain)
    model, bias = served_model(client), {str(forced): 100}
    http = client.completions.create(model=model, prompt=prompt, logit_bias=bias, **GREEDY)
    assert http.choices[0].text == text
    chat = client.chat.completions.create(model=model, messages=MESSAGES, logit_bias=bias, **GREEDY)
    assert chat.choices[0].message.content == text


def test_logprobs_through_prefill_and_decode(cluster, client, model_dir) -> None:
    """P sends the first token's logprobs and the prompt's, D the rest's (gRPC); they equal one
    engine's. Over HTTP, `logprobs: 3` on /v1/completions and `logprobs` with `top_logprobs: 2`
    on chat give the same numbers in OpenAI's shapes, whole and streamed; bad values are 400s."""
    prompt = [5, 6, 7, 5, 6, 7, 9]
    tokens, entries, text, routed = routed_logprobs(cluster.router_address, prompt, MAX_TOKENS)
    ((one_tokens, one_entries, one_prompt),) = single_engine_runs(
        model_dir, [prompt], MAX_TOKENS, sampling={"logprobs": 3, "prompt_logprobs": 3}
    )
    assert tokens == one_tokens and len(entries) == MAX_TOKENS
    assert_logprobs_close(entries, one_entries)
    assert routed is not None and one_prompt is not None and routed.token_ids == tuple(prompt)
    assert_logprobs_close(routed.positions, one_prompt.positions)
    model = served_model(client)
    whole = client.completions.create(model=model, prompt=prompt, logprobs=3, **GREEDY)
    logprobs = whole.choices[0].logprobs
    assert whole.choices[0].text == text == "".join(logprobs.tokens)
    assert logprobs.token_logprobs == [e.logprob for e in entries]
    for top, entry in zip(logprobs.top_logprobs, entries, strict=True):  # keyed by string:
        assert set(top.values()) <= {v for _, v in entry.top}  # two tokens may read alike
        assert max(top.values()) == entry.logprob  # greedy: the token is the most likely
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(MAX_TOKENS)]
    chunks = client.completions.create(model=model, prompt=prompt, logprobs=3, stream=True,
                                       **GREEDY)  # fmt: skip
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for part in streamed for x in getattr(part, name)] == getattr(logprobs, name)
    chat = {"model": model, "messages": MESSAGES, "logprobs": True, "top_logprobs": 2, **GREEDY}
    content = client.chat.completions.create(**chat).choices[0].logprobs.content
    assert len(content) == MAX_TOKENS and all(len(e.top_logprobs) == 2 for e in content)
    assert all(e.logprob == e.top_logprobs[0].logprob and e.bytes == list(e.token.encode())
               for e in content)  # fmt: skip
    stream = client.chat.completions.create(stream=True, **chat)
    parts = [c.choices[0].logprobs for c in stream]
    assert [e for part in parts if part is not None for e in part.content] == content
    for extra, param in (
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": False}, "top_logprobs"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**{**chat, **extra})
        assert caught.value.body["param"] == param, caught.value.body


def test_echo_and_prompt_logprobs_through_prefill_and_decode(cluster, client) -> None:
    """`echo` with `logprobs: 3` (lm-eval's loglikelihood call): the prompt's text, then the
    completion's; the logprobs object covers the prompt's tokens (the first null) then the
    generated ones, with gRPC's numbers; vLLM's `prompt_logprobs` too. Streamed, the first
    chunk leads with the prompt; `max_tokens: 0` answers the prompt alone. Chat refuses echo."""
    prompt, model = [5, 6, 7, 5, 6, 7, 9], served_model(client)
    _, entries, text, grpc_prompt = routed_logprobs(cluster.router_address, prompt, 2)
    codec = load_text_model(ModelSection(path=str(cluster.spec.model_dir))).codec
    prompt_text, asked = codec.prompt_text(prompt), {**GREEDY, "max_tokens": 2, "logprobs": 3}
    asked["extra_body"] = {**GREEDY["extra_body"], "prompt_logprobs": 1}
    whole = client.completions.create(model=model, prompt=prompt, echo=True, **asked).choices[0]
    assert whole.text == prompt_text + text and len(whole.logprobs.tokens) == len(prompt) + 2
    want = [None, *(e.logprob for e in grpc_prompt.positions), *(e.logprob for e in entries)]
    assert whole.logprobs.token_logprobs == want and whole.logprobs.top_logprobs[0] is None
    vllm = whole.model_extra["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(prompt)
    for at, token, entry in zip(vllm[1:], prompt[1:], grpc_prompt.positions, strict=True):
        assert at[str(token)] == {"logprob": entry.logprob, "rank": entry.rank,
                                  "decoded_token": codec.token_string(token)}  # fmt: skip
    chunks = list(client.completions.create(model=model, prompt=prompt, echo=True, stream=True,
                                            **asked))  # fmt: skip
    assert chunks[0].choices[0].text.startswith(prompt_text)
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.tokens]
    assert streamed == whole.logprobs.tokens
    alone = client.completions.create(model=model, prompt=prompt, echo=True,
                                      **{**asked, "max_tokens": 0})  # fmt: skip
    assert alone.choices[0].text == prompt_text and alone.usage.completion_tokens == 0
    assert alone.choices[0].logprobs.token_logprobs == want[: len(prompt)]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=MESSAGES, extra_body={"echo": True})
    assert caught.value.body["param"] == "echo"


def test_bad_input_gets_openai_error_objects(cluster, client) -> None:
    model = served_model(client)
    cases = [
        ({"n": 65}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
        ({"top_p": 2.0}, "top_p"), ({"logprobs": 21}, "logprobs"), ({"max_tokens": 10**9}, "max_tokens"),
        ({"extra_body": {"top_logprobs": 2}}, "top_logprobs"),
        ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5000": 1}}, "logit_bias"),  # outside the vocabulary
    ]  # fmt: skip
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=model, prompt="hello", **extra)  # type: ignore[arg-type]
        error = caught.value.body
        assert caught.value.status_code == 400 and error["param"] == param, (extra, error)
        assert error["type"] == "invalid_request_error" and error["message"].startswith(param)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-nope", messages=MESSAGES)
    assert caught.value.body["code"] == "model_not_found" and model in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[])
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=[5, 10**6])  # out of the vocabulary
    assert caught.value.body["param"] == "prompt"
    status, body = http_post(cluster.http_url + "/completions", b"{not json")
    assert status == 400 and body["error"]["param"] == "body"
    status, body = http_post(
        cluster.http_url + "/completions", b'{"prompt": "x", "stream_options": {}}'
    )
    assert status == 400 and body["error"]["param"] == "stream_options"
    status, _, body = http_get(cluster.http_url + "/nowhere")
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}
    # JSON escapes of lone UTF-16 surrogates: no UTF-8 text holds them (was a 500)
    for raw, param in ((b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
                       (b'{"prompt": "a", "stop": ["\\udfff"]}', "stop")):  # fmt: skip
        status, body = http_post(cluster.http_url + "/completions", raw)
        assert status == 400 and body["error"]["param"] == param, body
        assert "surrogate" in body["error"]["message"]
    status, _, body = http_get(cluster.http_url + "/completions")  # aiohttp's own 405
    assert status == 405 and body["error"]["type"] == "invalid_request_error"


def test_client_disconnect_mid_stream_frees_the_blocks(cluster, client) -> None:
    model = served_model(client)
    stream = client.completions.create(
        model=model, prompt="The quick brown fox", stream=True, temperature=0.0, max_tokens=3000,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for _, chunk in zip(range(5), stream, strict=False):
        assert chunk.choices[0].finish_reason is None
    assert asyncio.run(worker_leaks(cluster)), "the request should hold blocks while it runs"
    stream.close()  # the connection drops with ~3000 tokens still to go (tens of seconds)
    _wait_until_freed(cluster, "the disconnected request")
    metrics = scrape(cluster.http_url.removesuffix("/v1") + "/metrics")
    assert metrics['dsv4_router_requests_total{code="CANCELLED",method="Generate"}'] == 1
    # n = 2: both choices' calls end when the client leaves
    stream = client.completions.create(
        model=model, prompt="The quick brown fox", stream=True, temperature=0.0, max_tokens=3000,
        n=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for _, chunk in zip(range(6), stream, strict=False):
        assert chunk.choices[0].finish_reason is None
    stream.close()
    _wait_until_freed(cluster, "a disconnected choice")
    metrics = scrape(cluster.http_url.removesuffix("/v1") + "/metrics")
    assert metrics['dsv4_router_requests_total{code="CANCELLED",method="Generate"}'] == 3


def _wait_until_freed(cluster, what: str, timeout_s: float = 5.0) -> None:
    give_up_s = time.monotonic() + timeout_s
    while asyncio.run(worker_leaks(cluster)):
        assert time.monotonic() < give_up_s, f"{what} still holds blocks"
        time.sleep(0.1)


def _wait_http(router: ExtraRouter, url: str) -> None:
    give_up_s = time.monotonic() + 60.0
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answers (503 until it can route)
        except OSError:
            assert router.process.poll() is None, "the router exited"
            assert time.monotonic() < give_up_s, "the router's HTTP port never opened"
            time.sleep(0.2)


def test_api_key_rate_limit_and_no_worker(model_dir) -> None:
    port = free_port()
    router = ExtraRouter(
        str(model_dir), [], [], "--http-port", str(port), "--api-key", "k1",
        "--rate-limit-rps", "0.01", "--rate-limit-burst", "1",
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_http(router, base + "/health")
        assert http_get(base + "/health")[0] == 503  # nothing to route to
        with openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0) as anonymous:
            with pytest.raises(openai.AuthenticationError):
                anonymous.models.list()
            with pytest.raises(openai.AuthenticationError):
                anonymous.completions.create(model="m", prompt="hello")
        with openai.OpenAI(base_url=base + "/v1", api_key="k1", max_retries=0) as keyed:
            with pytest.raises(openai.APIStatusError) as caught:
                keyed.completions.create(model="", prompt="hello")
            assert caught.value.status_code == 503, caught.value.body
            with pytest.raises(openai.RateLimitError) as caught:
                keyed.completions.create(model="", prompt="hello")
            assert int(caught.value.response.headers["Retry-After"]) >= 1
        router.stop()
        assert router.process.returncode == 0  # SIGTERM stops the HTTP front cleanly too
    finally:
        router.stop()


def test_deadline_is_504_whole_and_an_error_event_streamed(cluster, model_dir) -> None:
    port = free_port()
    router = ExtraRouter(
        str(model_dir), cluster.addresses("prefill"), cluster.addresses("decode"),
        "--http-port", str(port), "--request-timeout-s", "1",
    )  # fmt: skip
    long = {"prompt": "Readability counts.", "max_tokens": 3000, "extra_body": {"ignore_eos": True}}
    try:
        router.wait_ready()
        _wait_http(router, f"http://127.0.0.1:{port}/health")
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0) as c:
            with pytest.raises(openai.APIStatusError) as caught:
                c.completions.create(model="", **long)  # type: ignore[arg-type]
            assert caught.value.status_code == 504, caught.value.body
            with pytest.raises(openai.APIError, match="deadline"):  # an error event mid-stream
                for _ in c.completions.create(model="", stream=True, **long):  # type: ignore[arg-type]
                    pass
    finally:
        router.stop()
    asyncio.run(assert_no_worker_leaks(cluster))


def test_loadtest_openai_backends_drive_the_front(cluster, client) -> None:
    """`dsv4 loadtest --backend openai|openai-chat` against this front: every request succeeds
    with in-vocabulary prompts drawn from the vocabulary size /v1/models lists."""
    for backend in ("openai", "openai-chat"):
        done = subprocess.run(
            [sys.executable, "-m", "dsv4.commands.cli", "loadtest", "--backend", backend, "--base-url",
             cluster.http_url.removesuffix("/v1"), "--num-prompts", "2", "--random-input-len", "16",
             "--random-output-len", "4", "--request-rate", "inf", "--disable-tqdm"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert re.search(r"Successful requests:\s+2\b", done.stdout), done.stdout
