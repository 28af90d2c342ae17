"""vLLM's tokenizer routes on the HTTP front: POST /tokenize, POST /detokenize, GET /version.

Shapes as vLLM's (TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest):
- /tokenize takes `{"model"?, "prompt": str, "add_special_tokens"?: true}` or `{"model"?,
  "messages": [...], "add_generation_prompt"?: true, "chat_template_kwargs"?,
  "add_special_tokens"?: false}`, either with `"return_token_strs"?: false`, and answers
  `{"count", "max_model_len", "tokens"}`, plus `"token_strs"` (each token's vocabulary string,
  as transformers' `convert_ids_to_tokens` spells it) when asked. Messages are checked and
  rendered as /v1/chat/completions does (protocol.parse_chat_prompt, chat.py), so by default
  `tokens` are the ids the chat route feeds the model. `add_special_tokens` lets the
  tokenizer's post-processor add its own tokens (a BOS, ...): this router's /v1/completions
  feeds a text prompt without them, so with vLLM's default (true) a tokenizer whose
  post-processor adds a BOS counts one token more here than that route feeds.
- /detokenize takes `{"model"?, "tokens": [int, ...]}`, every id in the tokenizer's
  vocabulary (the tokenizer would skip any other without a word), and answers `{"prompt":
  text}`, special tokens spelled out (as vLLM decodes them).
- /version answers `{"version": the dsv4-serve package's version}`.

Bounded work, as Generate's (router_svc/intake.py): a text whose UTF-8 bytes prove it holds more
than max_model_len tokens is refused before tokenizing (vLLM counts past max_model_len; so does
this route, up to that bound), and long texts and id lists are (de)tokenized in the router's
tokenizer pool, off the event loop, 429 beyond its bound. The body is bounded by
router.max_message_bytes (413 above it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

from aiohttp import web

from dsv4.errors import Dsv4Error
from dsv4.text.tokenizer import TextCodec
from router_svc.http.chat import ChatTemplate
from router_svc.http.errors import bad_request, shown
from router_svc.http.protocol import ChatPrompt, flag, parse_chat_prompt
from router_svc.intake import INLINE_PROMPT_CHARS, TokenizerPool, check_prompt_bytes
from router_svc.text_model import TextModel

T = TypeVar("T")
# At most this many ids are decoded on the event loop (well under a millisecond), as
# INLINE_PROMPT_CHARS bounds the text tokenized there.
INLINE_TOKEN_IDS = 2048
# The chat template's options: a plain prompt has none, and would be tokenized without them.
_CHAT_ONLY = ("add_generation_prompt", "chat_template_kwargs")


def render_chat(template: ChatTemplate, messages, add_generation_prompt: bool,
                variables) -> str:  # fmt: skip
    """The chat template applied as /v1/chat/completions applies it; a template error is the
    request's 400 on `messages`."""
    try:
        return template.render(list(messages), add_generation_prompt=add_generation_prompt,
                               variables=variables)  # fmt: skip
    except Dsv4Error as exc:
        raise bad_request("messages", exc.message) from exc


def package_version() -> str:
    try:
        return version("dsv4-serve")
    except PackageNotFoundError:  # a source tree not pip-installed: still a PEP 440 version
        return "0+unknown"


async def version_route(request: web.Request) -> web.Response:
    return web.json_response({"version": package_version()})


@dataclass(frozen=True)
class TokenizeRequest:
    """One /tokenize body, shape-checked: a prompt, or a chat to render first."""

    model: str
    prompt: str | None
    chat: ChatPrompt | None
    add_special_tokens: bool
    return_token_strs: bool

    @property
    def param(self) -> str:
        """The field an error about the text names."""
        return "prompt" if self.chat is None else "messages"


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("body", "the request body must be a JSON object")
    return body


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model", f"model = {shown(model)}: must be a string")
    return model or ""


def parse_tokenize(body: Any) -> TokenizeRequest:
    """Check a /tokenize body's shape; raises ApiError(400) naming the parameter."""
    body = _object(body)
    model = _model(body)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise bad_request("messages" if has_prompt else "prompt", "send prompt (the text to "
                          "tokenize) or messages (a chat to render and tokenize): one of "
                          "them")  # fmt: skip
    if has_prompt:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad_request("prompt", f"prompt = {shown(prompt)}: must be a string (the text "
                              "to tokenize; a chat goes in messages)")  # fmt: skip
        for name in _CHAT_ONLY:
            if body.get(name) is not None:
                raise bad_request(name, f"{name} applies to messages, not to a prompt: leave "
                                  "it unset")  # fmt: skip
        return TokenizeRequest(model, prompt, None, flag(body, "add_special_tokens", True),
                               flag(body, "return_token_strs", False))  # fmt: skip
    chat = parse_chat_prompt(body)  # the template writes its special tokens: none added
    return TokenizeRequest(model, None, chat, flag(body, "add_special_tokens", False),
                           flag(body, "return_token_strs", False))  # fmt: skip


def parse_detokenize(body: Any) -> tuple[str, list[int]]:
    """(model, token ids) of a /detokenize body; their vocabulary is checked with the
    tokenizer (`Tokenization.detokenize`)."""
    body = _object(body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad_request("tokens", f"tokens = {shown(tokens)}: must be a list of token ids "
                          "(integers)")  # fmt: skip
    if not all(type(t) is int for t in tokens):  # JSON true is a bool, 1.0 a float: neither
        i, bad = next((i, t) for i, t in enumerate(tokens) if type(t) is not int)
        raise bad_request("tokens", f"tokens[{i}] = {shown(bad)}: must be a token id (an "
                          "integer)")  # fmt: skip
    return _model(body), tokens


def _check_vocabulary(tokens: list[int], vocab_size: int) -> None:
    if tokens and min(tokens) >= 0 and max(tokens) < vocab_size:
        return
    for i, token in enumerate(tokens):
        if not 0 <= token < vocab_size:
            raise bad_request("tokens", f"tokens[{i}] = {shown(token)}: not in the "
                              f"tokenizer's vocabulary (ids 0 to {vocab_size - 1})")  # fmt: skip


class Tokenization:
    """The work of /tokenize and /detokenize with the router's tokenizer, chat template and
    tokenizer pool; the front checks the API key, the body and the model name first. Raises
    ApiError for the request's faults, Dsv4Error for the router's (no worker yet: no
    max_model_len; the pool full), which the front maps."""

    def __init__(self, text: TextModel, chat: ChatTemplate, pool: TokenizerPool) -> None:
        self._text, self._chat, self._pool = text, chat, pool

    def _codec(self, param: str, route: str) -> TextCodec:
        if self._text.codec is None:
            raise bad_request(param, f"this router has no tokenizer, which {route} needs: set "
                              "model.tokenizer (a tokenizer.json, or a checkpoint directory "
                              "holding one)")  # fmt: skip
        return self._text.codec

    async def _run(self, work: Callable[[], T], *, inline: bool) -> T:
        return work() if inline else await self._pool.run(work)

    async def tokenize(
        self, asked: TokenizeRequest, max_model_len: Callable[[], int]
    ) -> dict[str, Any]:
        """The answer to `asked`; `max_model_len()`: the served model's (Dsv4Error when no
        worker has reported it)."""
        codec = self._codec(asked.param, "/tokenize")
        text = self._render(asked.chat) if asked.chat is not None else asked.prompt or ""
        limit = max_model_len()
        try:
            check_prompt_bytes(text, limit, self._text.max_token_bytes)
        except Dsv4Error as exc:
            raise bad_request(asked.param, exc.message) from exc

        def encode() -> tuple[list[int], list[str]]:
            ids = self._text.encode(text, asked.add_special_tokens)
            strs = [codec.token_text(i) or "" for i in ids] if asked.return_token_strs else []
            return ids, strs

        ids, strs = await self._run(encode, inline=len(text) <= INLINE_PROMPT_CHARS)
        answer: dict[str, Any] = {"count": len(ids), "max_model_len": limit, "tokens": ids}
        if asked.return_token_strs:
            answer["token_strs"] = strs
        return answer

    def _render(self, chat: ChatPrompt) -> str:
        """The prompt the chat route renders for the same messages and options."""
        return render_chat(self._chat, chat.messages, chat.add_generation_prompt,
                           chat.chat_template_kwargs)  # fmt: skip

    async def detokenize(self, tokens: list[int]) -> dict[str, Any]:
        codec = self._codec("tokens", "/detokenize")
        _check_vocabulary(tokens, codec.vocab_size)
        text = await self._run(
            lambda: self._text.prompt_text(tokens), inline=len(tokens) <= INLINE_TOKEN_IDS
        )
        return {"prompt": text}
