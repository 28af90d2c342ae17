"""The OpenAI-compatible HTTP front: an aiohttp server on the router's own event loop.

Routes: POST /v1/completions, POST /v1/chat/completions (SSE with `stream: true`), GET
/v1/models, GET /v1/models/{id} (404 `model_not_found` for another id), GET /health (200 while
some request could be routed, else 503: the readiness the gRPC health service reports as
"dsv4.v1.Router"), GET /metrics (the router's Prometheus registry), and vLLM's POST /tokenize,
POST /detokenize and GET /version (tokenize.py). /v1 routes, /tokenize and /detokenize need
`Authorization: Bearer KEY` when router.api_keys is set: vLLM keys /v1 alone, but these two
spend the router's tokenizer on bodies up to router.max_message_bytes, and every client of a
keyed router holds a key. /health, /metrics and /version do no work a client chooses: open.

A generation request is checked (API key, its body read within BODY_READ_TIMEOUT_S and parsed
(body.py), its shape, model name, and choices no more than the router admits at once), chat
messages are rendered to a prompt (chat.py), and the rest is the gRPC Generate path run
in-process (call.py). Status is decided by the first chunk: an error before it is the HTTP error
(400 / 401 / 404 / 408 / 429 with Retry-After / 503 / 504); after it, the SSE stream carries one
`{"error": ...}` event and ends. The server cancels a handler whose client disconnected
(`handler_cancellation`), which cancels the in-process call and so frees the request's blocks
on the workers.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, aclosing
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from dsv4.config import ServeConfig
from dsv4.errors import Dsv4Error, to_grpc_status
from dsv4.serving.metrics import RouterMetrics
from dsv4.serving.ports import listen_failure
from dsv4.types import StreamChunk
from router_svc.admission import AUTHORIZATION_KEY, check_api_key
from router_svc.http.body import BODY_READ_TIMEOUT_S, check_unicode, read_json
from router_svc.http.call import InProcessCall
from router_svc.http.chat import ChatTemplate
from router_svc.http.choices import choice_protos, first_chunks, merged_events, whole_answer
from router_svc.http.errors import ApiError, ServerLog, api_error, bad_request, openai_errors, shown
from router_svc.http.logprobs import token_texts
from router_svc.http.protocol import OpenAIRequest, parse_request
from router_svc.http.responses import SSE_DONE, Reply, sse_event
from router_svc.http.tokenize import (
    Tokenization,
    parse_detokenize,
    parse_tokenize,
    render_chat,
    version_route,
)
from router_svc.pool import WorkerPool
from router_svc.servicer import RouterServicer
from router_svc.text_model import TextModel

REQUEST_ID_HEADER = "X-Request-Id"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def peer_of(request: web.Request) -> str:
    """The client as gRPC names peers ("ipv4:HOST:PORT"), so rate limits key on the host."""
    peername = request.transport.get_extra_info("peername") if request.transport else None
    if not peername:
        return "unknown"
    host, port = peername[0], peername[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


class HttpFront:
    """Built by the RouterServer when router.http_port is set; `start()` / `stop()` on its loop."""

    def __init__(
        self,
        cfg: ServeConfig,
        servicer: RouterServicer,
        pool: WorkerPool,
        metrics: RouterMetrics,
        registry: CollectorRegistry,
        text: TextModel,
        chat: ChatTemplate,
    ) -> None:
        self._cfg, self._servicer, self._pool = cfg, servicer, pool
        self._metrics, self._registry = metrics, registry
        self._text, self._chat = text, chat
        self._token_text = token_texts(text.codec)  # logprobs' token strings, cached
        self._tokens = Tokenization(text, chat, servicer.tokenizer_pool)
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.body_timeout_s = BODY_READ_TIMEOUT_S  # a request body's read, then 408

    @property
    def url(self) -> str:
        return f"http://{self._cfg.router.host}:{self.port}/v1"

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[openai_errors], client_max_size=self._cfg.router.max_message_bytes
        )
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)  # ids hold "/" (paths)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", version_route)
        return app

    async def start(self) -> None:
        """Bind and serve; raises Unavailable when the port is taken."""
        r = self._cfg.router
        runner = web.AppRunner(
            self.app(), handler_cancellation=True, access_log=None,
            shutdown_timeout=self._cfg.worker.drain_timeout_s,
            logger=ServerLog(logging.getLogger("aiohttp.server"), {}),
        )  # fmt: skip
        await runner.setup()
        site = web.TCPSite(runner, r.host, r.http_port, reuse_port=False)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise listen_failure(r.host, r.http_port, "listen for HTTP",
                                 "pick a free router.http_port", exc) from exc  # fmt: skip
        self._runner = runner
        self.port = runner.addresses[0][1]

    async def stop(self) -> None:
        """Stop listening; running requests get worker.drain_timeout_s (the router's grace on
        SIGTERM), then are cancelled. Idempotent."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # ---- plain endpoints -----------------------------------------------------------------------

    def _check_key(self, request: web.Request, method: str) -> None:
        metadata = [(AUTHORIZATION_KEY, request.headers.get("Authorization", ""))]
        try:
            check_api_key(metadata, self._cfg.router.api_keys)
        except Dsv4Error as exc:
            self._metrics.rejections.labels(reason="api_key").inc()
            self._metrics.requests.labels(method=method, code="UNAUTHENTICATED").inc()
            raise api_error(exc) from exc

    def _model_name(self) -> str | None:
        """The served model's name; None before any worker reported (the call then fails in
        the servicer, after admission and rate limits, as over gRPC)."""
        try:
            return self._servicer.model_info().model_name
        except Dsv4Error:
            return None

    def _check_model(self, asked: str) -> str | None:
        """The served model's name (or None, as `_model_name`); 404 when the request names
        another (no name: the served one, as in vLLM)."""
        served = self._model_name()
        if asked and served is not None and asked != served:
            raise ApiError(404, f"model {shown(asked)} is not served here: use {served!r} "
                           "(GET /v1/models)", param="model", code="model_not_found")  # fmt: skip
        return served

    def _max_model_len(self) -> int:
        return self._servicer.model_info().max_model_len

    def _model_object(self, request: web.Request) -> dict[str, Any]:
        self._check_key(request, "GetModelInfo")
        try:
            info = self._servicer.model_info()
        except Dsv4Error as exc:
            raise api_error(exc) from exc
        # max_model_len as vLLM lists it; vocab_size is ours (clients ignore unknown keys), so a
        # load generator can draw in-vocabulary token-id prompts without the tokenizer.
        return {"id": info.model_name, "object": "model", "created": 0, "owned_by": "dsv4",
                "max_model_len": info.max_model_len, "vocab_size": info.vocab_size}  # fmt: skip

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_object(request)]})

    async def model(self, request: web.Request) -> web.Response:
        """One model (the openai client's `models.retrieve`): the served one, else 404."""
        model, wanted = self._model_object(request), request.match_info["model"]
        if wanted != model["id"]:
            raise ApiError(404, f"model {shown(wanted)} is not served here: this router serves "
                           f"{model['id']!r}", param="model", code="model_not_found")  # fmt: skip
        return web.json_response(model)

    async def health(self, request: web.Request) -> web.Response:
        if self._pool.snapshot().has_route:
            return web.json_response({"status": "ok"})
        raise ApiError(503, "no prefill/decode route is healthy yet", code="unavailable")

    async def prometheus(self, request: web.Request) -> web.Response:
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def tokenize(self, request: web.Request) -> web.Response:
        self._check_key(request, "Tokenize")
        asked = parse_tokenize(await self._body(request))
        self._check_model(asked.model)
        try:
            return web.json_response(await self._tokens.tokenize(asked, self._max_model_len))
        except Dsv4Error as exc:  # no worker reported max_model_len yet (503), pool full (429)
            raise api_error(exc) from exc

    async def detokenize(self, request: web.Request) -> web.Response:
        self._check_key(request, "Detokenize")
        model, tokens = parse_detokenize(await self._body(request))
        self._check_model(model)
        try:
            return web.json_response(await self._tokens.detokenize(tokens))
        except Dsv4Error as exc:  # the pool full (429)
            raise api_error(exc) from exc

    # ---- generation ----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, is_chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, is_chat=True)

    async def _body(self, request: web.Request) -> Any:
        body = await read_json(request, self.body_timeout_s)
        check_unicode(body)
        return body

    def _prompt(self, parsed: OpenAIRequest) -> str | tuple[int, ...]:
        if parsed.prompt is not None:
            return parsed.prompt
        if self._text.codec is None:
            raise bad_request("messages", "this router has no tokenizer, which chat needs: "
                              "set model.tokenizer, or use /v1/completions with token ids")  # fmt: skip
        return render_chat(self._chat, parsed.messages, parsed.add_generation_prompt,
                           parsed.chat_template_kwargs)  # fmt: skip

    def _check_admissible(self, parsed: OpenAIRequest) -> None:
        """Each choice is admitted as its own request (choices.py): a request of more choices
        than the router admits at once could never be served, so it is a 400, not a 429 that
        no retry ends."""
        limiter, choices = self._servicer.limiter, parsed.num_choices
        limits = [(self._servicer.gate.max_inflight, "router.max_inflight_requests")]
        if limiter.is_enabled:
            limits.append((limiter.burst, "router.rate_limit_burst"))
        for limit, name in limits:
            if choices > limit:
                asked = f"n = {parsed.n}" if not parsed.batch else (
                    f"{len(parsed.batch)} prompts x n = {parsed.n}")  # fmt: skip
                param = "n" if parsed.n > 1 else "prompt"
                raise bad_request(param, f"{asked}: {choices} choices, each admitted as one "
                                  f"request, exceed this router's limit of {limit} at once "
                                  f"({name}): ask for at most {limit}")  # fmt: skip

    async def _generate(self, request: web.Request, *, is_chat: bool) -> web.StreamResponse:
        self._check_key(request, "Generate")
        parsed = parse_request(await self._body(request), is_chat=is_chat)
        try:
            return await self._answer(request, parsed, is_chat=is_chat)
        except ApiError as exc:
            sent = parsed.as_sent(exc)  # the value the client sent, not its int32 clamp
            if sent is exc:
                raise
            raise sent from exc

    async def _answer(
        self, request: web.Request, parsed: OpenAIRequest, *, is_chat: bool
    ) -> web.StreamResponse:
        served = self._check_model(parsed.model)
        self._check_admissible(parsed)
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        prompts = list(parsed.batch) or [self._prompt(parsed)]
        metadata = [(AUTHORIZATION_KEY, request.headers.get("Authorization", ""))]
        if parsed.num_choices > 1:
            return await self._choices(request, parsed, prompts, request_id, served, metadata,
                                       is_chat=is_chat)  # fmt: skip
        reply = self._reply(parsed, request_id, served, prompts[0], is_chat=is_chat)
        proto = parsed.to_proto(prompts[0], request_id)
        call = InProcessCall(self._servicer, proto, metadata=metadata, peer=peer_of(request))
        async with aclosing(call.stream()) as chunks:
            first = await anext(chunks, None)  # an ApiError here is the HTTP status
            if first is None:
                raise ApiError(500, "the request ended without output", code="internal")
            if not parsed.stream:
                reply.add(first)
                async for chunk in chunks:
                    reply.add(chunk)
                return web.json_response(reply.whole(), headers={REQUEST_ID_HEADER: request_id})
            return await self._sse(request, request_id, _events(reply, first, chunks))

    async def _choices(
        self, request: web.Request, parsed: OpenAIRequest,
        prompts: list[str | tuple[int, ...]], request_id: str, served: str | None,
        metadata: list[tuple[str, str]], *, is_chat: bool,
    ) -> web.StreamResponse:  # fmt: skip
        """Several choices (choices.py): a call each, the status once every choice has its
        first chunk."""
        replies = [self._reply(parsed, request_id, served, prompts[i // parsed.n],
                               is_chat=is_chat, index=i, usage_chunk=False)
                   for i in range(parsed.num_choices)]  # fmt: skip
        try:  # all choices at once: never some admitted, then the request refused
            self._servicer.charge_rate_limit(metadata, peer_of(request), parsed.num_choices)
        except Dsv4Error as exc:
            self._metrics.requests.labels(method="Generate", code=to_grpc_status(exc)[0].name).inc()
            raise api_error(exc) from exc
        calls = [InProcessCall(self._servicer, proto, metadata=metadata, peer=peer_of(request),
                               rate_limit_paid=True, counts_prompt=i % parsed.n == 0)
                 for i, proto in enumerate(choice_protos(parsed, prompts, request_id))]  # fmt: skip
        async with AsyncExitStack() as stack:
            streams = [await stack.enter_async_context(aclosing(c.stream())) for c in calls]
            firsts = await first_chunks(streams)
            if not parsed.stream:
                whole = await whole_answer(replies, firsts, streams, parsed.n)
                return web.json_response(whole, headers={REQUEST_ID_HEADER: request_id})
            events = merged_events(replies, firsts, streams, parsed.n)
            return await self._sse(request, request_id, events)

    def _reply(
        self, parsed: OpenAIRequest, request_id: str, served: str | None,
        prompt: str | tuple[int, ...], *, is_chat: bool, index: int = 0, usage_chunk: bool = True,
    ) -> Reply:  # fmt: skip
        """The answer for one choice of `prompt` (its text leads the answer with echo)."""
        echo = self._echo_text(prompt) if parsed.echo else None
        return Reply(is_chat, request_id, served or parsed.model, parsed.include_usage,
                     index=index, usage_chunk=usage_chunk, logprobs=parsed.logprobs,
                     token_text=self._token_text, echo=echo, echo_only=parsed.echo_only,
                     prompt_logprobs=parsed.prompt_logprobs)  # fmt: skip

    def _echo_text(self, prompt: str | tuple[int, ...]) -> str:
        """The prompt as `echo` answers it: its text, or a token-id prompt decoded with its
        special tokens spelled out (as vLLM does)."""
        if isinstance(prompt, str):
            return prompt
        if self._text.codec is None:
            raise bad_request("echo", "echo of a token-id prompt needs the router's tokenizer "
                              "to write its text: set model.tokenizer, or leave echo unset")  # fmt: skip
        return self._text.codec.prompt_text(list(prompt))

    async def _sse(
        self, request: web.Request, request_id: str, events: AsyncIterator[bytes]
    ) -> web.StreamResponse:
        """Stream the events; an error raised while making them (after the first chunk) is one
        `{"error": ...}` event before `[DONE]` (what the openai client raises from)."""
        headers = {**SSE_HEADERS, REQUEST_ID_HEADER: request_id}
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        try:
            async with aclosing(events):
                async for event in events:
                    await response.write(event)
        except ApiError as exc:
            await response.write(sse_event(exc.body()))
        except ConnectionResetError:
            return response  # the client left; the caller closes the streams, cancelling calls
        await response.write(SSE_DONE)
        await response.write_eof()
        return response


async def _events(
    reply: Reply, first: StreamChunk, chunks: AsyncIterator[StreamChunk]
) -> AsyncIterator[bytes]:
    """One choice's SSE events: `first`, then the rest of its chunks."""
    for event in reply.stream_events(first):
        yield event
    async for chunk in chunks:
        for event in reply.stream_events(chunk):
            yield event
