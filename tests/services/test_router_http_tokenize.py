"""vLLM's utility routes at the router's HTTP front (router_svc/http/tokenize.py): POST /tokenize,
POST /detokenize and GET /version, on a real front in front of scripted workers (whose logs
show the token ids the model is fed).

Plain text round-trips; a chat's tokens are the ids /v1/chat/completions feeds the prefill
worker; `add_special_tokens` follows vLLM's defaults (prompt: true, chat: false) with a
tokenizer whose post-processor adds a BOS; long texts and id lists take the tokenizer pool;
every bad body is a 4xx with a one-line OpenAI error object and nothing logged as an error;
a router without a tokenizer says so; the routes take the API key as /v1 does, /version
does not."""

from __future__ import annotations

import logging
from importlib.metadata import version
from typing import Any

import aiohttp
import pytest
from tokenizers import processors

from dsv4.rpc.v1 import common_pb2, router_pb2
from dsv4.serving.ports import free_port
from dsv4.text.tokenizer import BOS_TOKEN, build_tokenizer
from router_svc.text_model import TextModel, text_model
from tests.router_fakes.harness import scripted_cluster, tiny_text_model
from tests.services.test_router_http_input import front, no_errors_logged, post, refused, run

CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "The quick brown fox jumps over the lazy dog"},
]
TEXTS = ["Readability counts.", "def forward(self, x): return x  # 1234567890", " a\tb\n c ", ""]


def root(url: str) -> str:
    return url.removesuffix("/v1")


async def get(url: str, **headers: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as r:
        return r.status, await r.json(content_type=None)


def test_plain_text_round_trips_and_counts_its_tokens() -> None:
    async def body() -> None:
        async with front() as (c, url):
            max_model_len = c.server.servicer.model_info().max_model_len
            for text in TEXTS:
                status, answer = await post(root(url) + "/tokenize", {"prompt": text})
                assert status == 200, answer
                assert answer == {"count": len(answer["tokens"]), "max_model_len": max_model_len,
                                  "tokens": tiny_text_model().encode(text)}  # fmt: skip
                back = await post(root(url) + "/detokenize", {"tokens": answer["tokens"]})
                assert back == (200, {"prompt": text})
            status, answer = await post(root(url) + "/tokenize", {
                "prompt": "Readability counts.", "return_token_strs": True,
                "model": "scripted"})  # fmt: skip
            assert status == 200 and len(answer["token_strs"]) == answer["count"] > 1, answer
            assert "".join(answer["token_strs"]).replace("Ġ", " ") == "Readability counts."
            special = await post(root(url) + "/detokenize", {"tokens": [0, *answer["tokens"]]})
            assert special == (200, {"prompt": BOS_TOKEN + "Readability counts."})  # spelled out

    run(body())


def test_a_chat_tokenizes_to_what_the_chat_route_feeds_the_model() -> None:
    async def body() -> None:
        async with front() as (c, url):
            options = ({}, {"add_generation_prompt": False},
                       {"chat_template_kwargs": {"thinking": False}})  # fmt: skip
            for extra in options:
                status, answer = await post(url + "/chat/completions",
                                            {"messages": CHAT, "max_tokens": 2, **extra})  # fmt: skip
                assert status == 200, answer
                fed = list(c.prefills[0].log.requests[-1].prompt_token_ids)
                status, tokenized = await post(root(url) + "/tokenize",
                                               {"messages": CHAT, **extra})  # fmt: skip
                assert status == 200, tokenized
                assert tokenized["tokens"] == fed, extra
                assert tokenized["count"] == answer["usage"]["prompt_tokens"]
            status, answer = await post(url + "/completions", {"prompt": TEXTS[1], "max_tokens": 2})
            assert status == 200, answer
            fed = list(c.prefills[0].log.requests[-1].prompt_token_ids)
            tokenized = await post(root(url) + "/tokenize", {"prompt": TEXTS[1]})
            assert tokenized[1]["tokens"] == fed  # the tiny tokenizer adds no special token

    run(body())


def test_add_special_tokens_follows_vllm_defaults_with_a_bos_adding_tokenizer() -> None:
    """vLLM's defaults: true for a prompt (the post-processor's BOS), false for a chat (the
    template wrote its own)."""
    tokenizer = build_tokenizer(1000)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, 0)]
    )

    async def body() -> None:
        async with front(text=text_model(tokenizer, source="bos")) as (_, url):
            plain = tokenizer.encode("hi", add_special_tokens=False).ids
            for extra, ids in (({}, [0, *plain]), ({"add_special_tokens": False}, plain)):
                status, answer = await post(root(url) + "/tokenize", {"prompt": "hi", **extra})
                assert (status, answer["tokens"]) == (200, ids), answer
            status, chat = await post(root(url) + "/tokenize", {"messages": CHAT})
            assert status == 200 and chat["tokens"][:2] != [0, 0], chat  # one BOS: the template's
            status, more = await post(root(url) + "/tokenize",
                                      {"messages": CHAT, "add_special_tokens": True})  # fmt: skip
            assert status == 200 and more["tokens"] == [0, *chat["tokens"]], more

    run(body())


def test_generation_feeds_what_tokenize_answers_with_a_bos_adding_tokenizer() -> None:
    """/v1/completions feeds the post-processor's BOS (vLLM's default), chat feeds the
    template's one BOS, `add_special_tokens` overrides either; a long prompt (the tokenizer
    pool's path) too. Before, text prompts were fed without it while /tokenize showed it."""
    tokenizer = build_tokenizer(1000)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, 0)]
    )
    long = "Errors should never pass silently. " * 120  # over INLINE_PROMPT_CHARS

    async def body() -> None:
        async with front(text=text_model(tokenizer, source="bos")) as (c, url):
            log = c.prefills[0].log.requests
            for route, sent in (
                ("/completions", {"prompt": "hi"}),
                ("/completions", {"prompt": long}),
                ("/completions", {"prompt": "hi", "add_special_tokens": False}),
                ("/chat/completions", {"messages": CHAT}),
                ("/chat/completions", {"messages": CHAT, "add_special_tokens": True}),
            ):
                status, answer = await post(url + route, {**sent, "max_tokens": 1})
                assert status == 200, answer
                asked = {k: v for k, v in sent.items() if k != "max_tokens"}
                status, tokenized = await post(root(url) + "/tokenize", asked)
                assert status == 200 and list(log[-1].prompt_token_ids) == tokenized["tokens"]
            fed = [list(r.prompt_token_ids[:2]) for r in log[-5:]]
            assert [f[0] == 0 for f in fed] == [True, True, False, True, True], fed
            assert fed[3][1] != 0 and fed[4][:2] == [0, 0]  # chat: the template's BOS alone
            for extra, first in (({}, [0]), ({"add_special_tokens": False}, [])):  # gRPC: unset
                sampling = common_pb2.SamplingParams(max_new_tokens=1)
                sent = router_pb2.GenerateRequest(prompt="hi", sampling=sampling, **extra)
                assert [m async for m in c.stub.Generate(sent)][-1].finish_reason
                plain = tokenizer.encode("hi", add_special_tokens=False).ids
                assert list(log[-1].prompt_token_ids) == [*first, *plain]

    run(body())


def test_long_texts_and_id_lists_go_through_the_pool_and_hold_the_byte_bound() -> None:
    async def body() -> None:
        async with front() as (c, url):
            text = "Errors should never pass silently. " * 120  # over INLINE_PROMPT_CHARS
            status, answer = await post(root(url) + "/tokenize", {"prompt": text})
            assert status == 200 and answer["tokens"] == tiny_text_model().encode(text)
            long = {"tokens": answer["tokens"] * 8}  # over INLINE_TOKEN_IDS
            assert await post(root(url) + "/detokenize", long) == (200, {"prompt": text * 8})
            pool = c.server.tokenizer_pool
            assert pool.num_admitted == 0
            pool.num_admitted = pool.max_admitted  # its threads and queue taken: long work waits
            try:
                for path, sent in (("/tokenize", {"prompt": text}), ("/detokenize", long)):
                    status, answer = await post(root(url) + path, sent)
                    assert status == 429 and "retry later" in answer["error"]["message"], answer
                assert (await post(root(url) + "/tokenize", {"prompt": "hi"}))[0] == 200  # inline
            finally:
                pool.num_admitted = 0
            limit = c.server.servicer.model_info().max_model_len
            huge = "x" * (limit * tiny_text_model().max_token_bytes + 1)  # more tokens, surely
            message = refused(*await post(root(url) + "/tokenize", {"prompt": huge}), "prompt")
            assert f"max_model_len = {limit}" in message, message

    run(body())


def test_bad_input_is_a_one_line_4xx(caplog: pytest.LogCaptureFixture) -> None:
    chat_off = {"messages": CHAT, "chat_template": "{{ messages }}"}
    cases = [
        ("/tokenize", b"", "body", "not valid JSON"),
        ("/tokenize", b'{"prompt": "hi",', "body", "not valid JSON"),
        ("/tokenize", b"[]", "body", "must be a JSON object"),
        ("/tokenize", {}, "prompt", "send prompt (the text to tokenize) or messages"),
        ("/tokenize", {"prompt": [1, 2]}, "prompt", "prompt = [...]: must be a string"),
        ("/tokenize", {"prompt": "hi", "messages": CHAT}, "messages", "one of them"),
        ("/tokenize", {"prompt": "a\ud800"}, "prompt", "lone UTF-16 surrogate"),
        ("/tokenize", {"prompt": "hi", "model": 5}, "model", "must be a string"),
        ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens",
         "true or false"),
        ("/tokenize", {"prompt": "hi", "return_token_strs": 1}, "return_token_strs",
         "true or false"),
        ("/tokenize", {"prompt": "hi", "add_generation_prompt": True}, "add_generation_prompt",
         "applies to messages"),
        ("/tokenize", {"messages": []}, "messages", "non-empty list"),
        ("/tokenize", {"messages": [{"role": "user", "content": 5}]}, "messages",
         "string or text parts"),
        ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, "messages",
         "not supported"),
        ("/tokenize", chat_off, "chat_template", "not supported"),
        ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools",
         "not supported"),
        ("/detokenize", {}, "tokens", "tokens = None: must be a list of token ids"),
        ("/detokenize", {"tokens": "1 2"}, "tokens", "must be a list of token ids"),
        ("/detokenize", {"tokens": [1, 2.0]}, "tokens", "tokens[1] = 2.0: must be a token id"),
        ("/detokenize", {"tokens": [True]}, "tokens", "tokens[0] = True: must be a token id"),
        ("/detokenize", {"tokens": [3, -1]}, "tokens", "tokens[1] = -1: not in the tokenizer's"),
        ("/detokenize", {"tokens": [10**30]}, "tokens", "not in the tokenizer's vocabulary"),
    ]  # fmt: skip

    async def body() -> None:
        async with front() as (_, url):
            vocab = tiny_text_model().codec.vocab_size
            at_the_end = {"tokens": [vocab]}
            for path, sent, param, says in [*cases, ("/detokenize", at_the_end, "tokens",
                                                     f"ids 0 to {vocab - 1}")]:  # fmt: skip
                assert says in refused(*await post(root(url) + path, sent), param), (path, sent)
            for path in ("/tokenize", "/detokenize"):
                status, answer = await post(root(url) + path, {"prompt": "hi", "tokens": [1],
                                                               "model": "other"})  # fmt: skip
                assert status == 404 and answer["error"]["code"] == "model_not_found", answer
                status, answer = await get(root(url) + path)
                assert status == 405 and "\n" not in answer["error"]["message"], answer
            oversized = b'{"prompt": "' + b"x" * (16 * 2**20) + b'"}'
            status, answer = await post(root(url) + "/tokenize", oversized)
            assert status == 413 and "router.max_message_bytes" in answer["error"]["message"]
            assert (await post(root(url) + "/tokenize", {"prompt": "hi"}))[0] == 200

    with caplog.at_level(logging.ERROR):
        run(body())
    no_errors_logged(caplog)


def test_a_router_without_a_tokenizer_says_so() -> None:
    async def body() -> None:
        async with front(text=TextModel(None)) as (_, url):
            for path, sent, param in (("/tokenize", {"prompt": "hi"}, "prompt"),
                                      ("/tokenize", {"messages": CHAT}, "messages"),
                                      ("/detokenize", {"tokens": [1, 2]}, "tokens")):  # fmt: skip
                message = refused(*await post(root(url) + path, sent), param)
                assert "no tokenizer" in message and "model.tokenizer" in message, message
            assert (await get(root(url) + "/version"))[0] == 200

    run(body())


def test_version_and_no_worker_yet() -> None:
    """/version is the package's; /tokenize needs a worker's max_model_len (503 before one
    reports), /detokenize needs no worker."""

    async def body() -> None:
        port = free_port()
        async with scripted_cluster(router__http_port=port):
            base = f"http://127.0.0.1:{port}"
            assert await get(base + "/version") == (200, {"version": version("dsv4-serve")})
            status, answer = await post(base + "/tokenize", {"prompt": "hi"})
            assert status == 503 and "no worker" in answer["error"]["message"], answer
            assert await post(base + "/detokenize", {"tokens": [5]}) == (200, {"prompt": "$"})

    run(body())


def test_tokenize_and_detokenize_take_the_api_key_version_does_not() -> None:
    async def body() -> None:
        async with front(router__api_keys=("k1",)) as (_, url):
            for path, sent in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
                status, answer = await post(root(url) + path, sent)
                assert status == 401 and answer["error"]["type"] == "authentication_error"
                status, answer = await post(root(url) + path, sent, Authorization="Bearer k1")
                assert status == 200, answer
            assert (await get(root(url) + "/version"))[0] == 200

    run(body())
