"""OpenAI request bodies -> `dsv4.v1.Router` GenerateRequest protos.

Only shapes and types are checked here; values (temperature range, max_tokens against the
context, stop strings, penalty and logit_bias ranges, vocabulary) are checked by the router's own
validation, the same rules as gRPC, whose message is then returned with the OpenAI
parameter's name. Fields that would change the result and that this server does not
implement (tools, ...) are refused, never silently ignored. `n` asks for that
many choices of each prompt, and /v1/completions takes a batch of prompts (strings or
token-id lists); a request holds at most MAX_CHOICES choices in all
(router_svc/http/choices.py). OpenAI's `presence_penalty`, `frequency_penalty` and
`logit_bias` (token ids as string keys) and vLLM's extensions `repetition_penalty`, `top_k`,
`ignore_eos`, `stop_token_ids` and `priority` (lower first, as vLLM's; the gRPC field's sign
is the other way) are accepted; vLLM's others that change the answer (`min_tokens`, `min_p`,
guided decoding, a request's `chat_template`, ...) are refused unless off. Logprobs:
/v1/completions' `logprobs: N`, chat's `logprobs: true` with `top_logprobs: N` (0 if unset),
N in [0, 20], become `SamplingParams.logprobs` (the answer's shapes: router_svc/http/logprobs.py).
/v1/completions' `echo: true` answers the prompt before the completion (with `logprobs: N`, its
tokens' logprobs first: `SamplingParams.prompt_logprobs` = N, as vLLM), `max_tokens: 0` with
echo the prompt alone (the engine still samples one token, left out of the answer), and vLLM's
`prompt_logprobs: N` its own field per choice; chat refuses both (400 naming them). Chat takes
vLLM's `add_generation_prompt` (default true) and `chat_template_kwargs` (more template
variables). Integers beyond int32 are clamped for the proto, and the router's message about
them echoes the value sent (`OpenAIRequest.as_sent`). A refusal is a 400 `ApiError` naming the
parameter (router_svc/http/errors.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dsv4.rpc.v1 import common_pb2, router_pb2
from dsv4.types import MAX_LOGPROBS
from router_svc.http.errors import ApiError, bad_request, shown

INT32_MAX = 2**31 - 1
MAX_CHOICES = 64  # prompts x n: each choice is its own Generate call (admission counts each)
_INTEGER = re.compile(r"-?[0-9]{1,12}")
# Parameters whose only supported value is "off": (name, the values that mean off). OpenAI's,
# then vLLM's extensions that change the answer on vLLM (min_tokens, min_p, guided decoding,
# ...): a vLLM client sends them, and ignoring them would answer something else without a word.
_OFF_ONLY = (
    ("best_of", (None, 1)), ("suffix", (None, "")), ("tools", (None, [])),
    ("functions", (None, [])), ("response_format", (None, {"type": "text"})),
    ("tool_choice", (None, "none", "auto")),
    ("min_tokens", (None, 0)), ("min_p", (None, 0)), ("use_beam_search", (None, False)),
    ("length_penalty", (None, 1)), ("include_stop_str_in_output", (None, False)),
    ("skip_special_tokens", (None, True)), ("allowed_token_ids", (None,)),
    ("bad_words", (None, [])), ("truncate_prompt_tokens", (None,)),
    ("return_tokens_as_token_ids", (None, False)), ("logits_processors", (None,)),
    ("guided_json", (None,)), ("guided_regex", (None,)), ("guided_choice", (None,)),
    ("guided_grammar", (None,)), ("structured_outputs", (None,)), ("prompt_embeds", (None,)),
)  # fmt: skip
_NOT_ON_CHAT = (("echo", (None, False)), ("prompt_logprobs", (None,)))  # /v1/completions' only
# vLLM's chat-only options this server does not implement (a per-request template, ...)
_CHAT_OFF_ONLY = (
    ("chat_template", (None,)), ("continue_final_message", (None, False)),
    ("documents", (None,)),
)  # fmt: skip
# What the template would render differently: its own options, and tools (templates list them)
_TEMPLATE_OFF_ONLY = (("tools", (None, [])), *_CHAT_OFF_ONLY)


@dataclass(frozen=True)
class OpenAIRequest:
    """One /v1/completions or /v1/chat/completions body, shape-checked."""

    model: str
    prompt: str | tuple[int, ...] | None  # None for chat: the messages are rendered later
    messages: tuple[dict[str, Any], ...]
    sampling: common_pb2.SamplingParams
    stream: bool
    include_usage: bool
    n: int = 1  # choices of each prompt
    batch: tuple[str | tuple[int, ...], ...] = ()  # /v1/completions with several prompts
    echo: bool = False  # /v1/completions: the prompt leads each choice's text
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (a token sampled, dropped)
    prompt_logprobs: int | None = None  # vLLM's field: N top logprobs per prompt position
    add_generation_prompt: bool = True  # chat: vLLM's field, the template opens the answer
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # chat: vLLM's field
    priority: int = 0  # vLLM's field: lower is served first (the gRPC field: larger first)
    # vLLM's field: a text prompt gets the tokenizer's special tokens (its BOS); chat's default
    # is false, the template wrote them
    add_special_tokens: bool = True
    # integers clamped to int32 for the proto: param -> (clamped, as sent), so the router's
    # range message echoes what the client sent
    clamped: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def num_choices(self) -> int:
        return max(1, len(self.batch)) * self.n

    @property
    def logprobs(self) -> int | None:
        """Top logprobs asked per generated token (None: no logprobs)."""
        return self.sampling.logprobs if self.sampling.HasField("logprobs") else None

    def as_sent(self, exc: ApiError) -> ApiError:
        """The router's refusal of a clamped integer with the value the client sent in its
        message ("max_tokens = 2147483647: ..." -> "max_tokens = 1000000000000: ...")."""
        clamped, sent = self.clamped.get(exc.param or "", (None, None))
        said = f"{exc.param} = {clamped}"
        if clamped is None or not exc.message.startswith(said):
            return exc
        message = f"{exc.param} = {sent}" + exc.message[len(said) :]
        return ApiError(exc.status, message, param=exc.param, code=exc.code,
                        retry_after_s=exc.retry_after_s)  # fmt: skip

    def to_proto(
        self, prompt: str | tuple[int, ...], request_id: str
    ) -> router_pb2.GenerateRequest:
        msg = router_pb2.GenerateRequest(request_id=request_id)
        if isinstance(prompt, str):
            msg.prompt = prompt
            msg.add_special_tokens = self.add_special_tokens
        else:
            msg.prompt_token_ids.ids.extend(prompt)
        msg.sampling.CopyFrom(self.sampling)
        msg.priority = -self.priority  # int32 clamped: its negation is one too
        return msg


def _typed(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise bad_request(name, f"{name} = {shown(value)}: must be {what}")
    return value


def flag(body: dict[str, Any], name: str, default: bool) -> bool:
    """A true / false parameter (`default` when unset)."""
    value = _typed(body, name, (bool,), "true or false")
    return default if value is None else value


def _int(
    body: dict[str, Any], name: str, clamped: dict[str, tuple[int, int]], param: str = ""
) -> int | None:
    """An integer parameter, clamped to int32 (the router's own range message is the clearer
    one; `clamped[param or name]` keeps what was sent, for that message)."""
    value = _typed(body, name, (int,), "an integer")
    if value is None:
        return None
    fitted = max(-INT32_MAX, min(value, INT32_MAX))
    if fitted != value:
        clamped[param or name] = (fitted, value)
    return fitted


def _sampling(
    body: dict[str, Any], is_chat: bool, clamped: dict[str, tuple[int, int]]
) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams()
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):  # fmt: skip
        if (value := _typed(body, name, (int, float), "a number")) is not None:
            setattr(msg, name, float(value))
    max_tokens = _int(body, "max_completion_tokens", clamped, "max_tokens")
    max_tokens = max_tokens if max_tokens is not None else _int(body, "max_tokens", clamped)
    if max_tokens is not None:
        msg.max_new_tokens = max_tokens
    seed = _typed(body, "seed", (int,), "an integer")
    if seed is not None and not 0 <= seed < 2**64:
        raise bad_request("seed", f"seed = {seed}: must be in [0, 2**64)")
    if seed is not None:
        msg.seed = seed
    top_k = _int(body, "top_k", clamped) or 0
    msg.top_k = 0 if top_k == -1 else top_k  # vLLM spells "off" as -1
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop", "stop must be a string or a list of strings")
    msg.stop.extend(stops)  # an empty one is refused by the router, as over gRPC
    msg.stop_token_ids.extend(_token_ids(body.get("stop_token_ids") or [], "stop_token_ids"))
    msg.ignore_eos = bool(_typed(body, "ignore_eos", (bool,), "true or false"))
    msg.logit_bias.update(_logit_bias(body.get("logit_bias")))
    logprobs = _chat_logprobs(body) if is_chat else _completion_logprobs(body, clamped)
    if logprobs is not None:
        msg.logprobs = logprobs
    return msg


def _completion_logprobs(body: dict[str, Any], clamped: dict[str, tuple[int, int]]) -> int | None:
    """`logprobs: N` (its range is the router's check, as over gRPC)."""
    if body.get("top_logprobs") is not None:
        raise bad_request("top_logprobs", "top_logprobs is a chat parameter: /v1/completions "
                          f"takes logprobs: N (0 to {MAX_LOGPROBS})")  # fmt: skip
    return _int(body, "logprobs", clamped)


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """`logprobs: true` with `top_logprobs: N` (0 if unset); None when logprobs is off."""
    asked = _typed(body, "logprobs", (bool,), "true or false")
    top = _typed(body, "top_logprobs", (int,), "an integer")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad_request("top_logprobs", f"top_logprobs = {top}: must be in [0, "
                          f"{MAX_LOGPROBS}] (the most likely tokens returned per token)")  # fmt: skip
    if top and not asked:
        raise bad_request("top_logprobs", "top_logprobs needs logprobs = true")
    return (top or 0) if asked else None


def _logit_bias(value: Any) -> dict[int, float]:
    """{"50256": -100, ...} -> {50256: -100.0}: keys token ids written as integers, values
    numbers (their range and the ids' vocabulary are the router's checks)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("logit_bias", "logit_bias must be an object of token id -> bias")
    out = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and _INTEGER.fullmatch(key) else None
        if token is None or not -INT32_MAX <= token <= INT32_MAX:
            raise bad_request("logit_bias", f"logit_bias key {shown(key)}: must be a token id "
                              '(an integer, written as a string: {"50256": -100})')  # fmt: skip
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise bad_request("logit_bias", f"logit_bias[{key}] = {shown(bias)}: must be a "
                              "number in [-100, 100]")  # fmt: skip
        out[token] = float(bias)
    return out


def _token_ids(value: Any, param: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and -INT32_MAX <= t <= INT32_MAX
        for t in value
    ):
        raise bad_request(param, f"{param} must be a list of token ids (integers)")
    return tuple(value)


def _prompts(body: dict[str, Any]) -> tuple[str | tuple[int, ...], ...]:
    """The request's prompts: one (a string or token ids; a list of one is one), or a batch of
    strings or of token-id lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return tuple(_token_ids(p, "prompt") for p in prompt)
    if isinstance(prompt, list) and any(isinstance(p, str | list) for p in prompt):
        raise bad_request("prompt", "a batch of prompts is all strings or all token-id lists")
    if isinstance(prompt, list):
        return (_token_ids(prompt, "prompt"),)
    raise bad_request("prompt", "prompt is required: a string or a list of token ids")


def _content(message: dict[str, Any], index: int) -> str:
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request(
                    "messages", f"messages[{index}].content: only text parts are supported"
                )
            where = f"messages[{index}].content[{j}]"
            if "text" not in part:
                raise bad_request("messages", f'{where} is a text part without text: send '
                                  '{"type": "text", "text": "..."}')  # fmt: skip
            if not isinstance(text := part["text"], str):
                raise bad_request("messages", f"{where}.text = {shown(text)}: must be a string")
            parts.append(text)
        return "".join(parts)
    raise bad_request("messages", f"messages[{index}].content must be a string or text parts")


def _messages(body: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "messages is required: a non-empty list of {role, content}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request("messages", f"messages[{i}] must be an object with a string role")
        out.append({**message, "content": _content(message, i)})
    return tuple(out)


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `chat_template_kwargs`: more variables for the chat template (they may set its
    own, `add_generation_prompt` or a special token, as in vLLM; not the messages)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs", f"chat_template_kwargs = {shown(kwargs)}: "
                          "must be an object of template variables")  # fmt: skip
    if "messages" in kwargs:
        raise bad_request("chat_template_kwargs", "chat_template_kwargs cannot set messages: "
                          "send them as the request's messages")  # fmt: skip
    return kwargs


@dataclass(frozen=True)
class ChatPrompt:
    """What a chat request gives the chat template: checked once here for /v1/chat/completions
    and /tokenize alike, so both render the same prompt from the same body."""

    messages: tuple[dict[str, Any], ...]
    add_generation_prompt: bool  # vLLM's field (default true): the template opens the answer
    chat_template_kwargs: Mapping[str, Any]  # vLLM's field: more template variables


def parse_chat_prompt(body: dict[str, Any]) -> ChatPrompt:
    """The template's input of a chat body; what this server cannot render (a request's own
    template, tools, ...) is refused unless off, as on /v1/chat/completions."""
    _refuse_unless_off(body, _TEMPLATE_OFF_ONLY)
    opens_answer = _typed(body, "add_generation_prompt", (bool,), "true or false")
    return ChatPrompt(_messages(body), opens_answer is not False, _template_kwargs(body))


def _refuse_unless_off(
    body: dict[str, Any], pairs: tuple[tuple[str, tuple[Any, ...]], ...]
) -> None:
    for name, off in pairs:
        if body.get(name) not in off:
            raise bad_request(name, f"{name} = {shown(body[name])} is not supported by this "
                              "server: leave it unset")  # fmt: skip


def parse_request(body: Any, *, is_chat: bool) -> OpenAIRequest:
    """Check one request body's shape; raises ApiError(400) naming the parameter."""
    if not isinstance(body, dict):
        raise bad_request("body", "the request body must be a JSON object")
    model = _typed(body, "model", (str,), "a string") or ""
    n = _typed(body, "n", (int,), "an integer")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request("n", f"n = {n}: must be in [1, {MAX_CHOICES}] (choices of each prompt)")
    _refuse_unless_off(body, (*_OFF_ONLY, *(_CHAT_OFF_ONLY if is_chat else ())))
    for name, off in _NOT_ON_CHAT if is_chat else ():
        if body.get(name) not in off:
            raise bad_request(name, f"{name} is not supported on /v1/chat/completions: leave "
                              "it unset (/v1/completions takes it)")  # fmt: skip
    stream = bool(_typed(body, "stream", (bool,), "true or false"))
    options = body.get("stream_options")
    if options is not None and not stream:
        raise bad_request("stream_options", "stream_options needs stream = true")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options", "stream_options must be an object")
    include_usage = bool(_typed(options or {}, "include_usage", (bool,), "true or false"))
    if (options or {}).get("continuous_usage_stats") not in (None, False):
        raise bad_request("stream_options", "stream_options.continuous_usage_stats is not "
                          "supported by this server: the last chunk carries the usage")  # fmt: skip
    prompts = () if is_chat else _prompts(body)
    batch = prompts if len(prompts) > 1 else ()
    if len(batch) * n > MAX_CHOICES:
        raise bad_request("prompt", f"{len(batch)} prompts x n = {n}: at most {MAX_CHOICES} "
                          "choices a request")  # fmt: skip
    clamped: dict[str, tuple[int, int]] = {}
    sampling = _sampling(body, is_chat, clamped)
    echo = bool(_typed(body, "echo", (bool,), "true or false"))
    echo_only = echo and sampling.HasField("max_new_tokens") and sampling.max_new_tokens == 0
    if echo_only:
        sampling.max_new_tokens = 1  # the engine samples one token at least
    prompt_logprobs = _prompt_logprobs(body, sampling, echo=echo)
    chat = parse_chat_prompt(body) if is_chat else ChatPrompt((), True, {})
    return OpenAIRequest(
        model=model,
        prompt=prompts[0] if len(prompts) == 1 else None,
        messages=chat.messages,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        n=n,
        batch=batch,
        echo=echo,
        echo_only=echo_only,
        prompt_logprobs=prompt_logprobs,
        add_generation_prompt=chat.add_generation_prompt,
        chat_template_kwargs=chat.chat_template_kwargs,
        priority=_int(body, "priority", clamped) or 0,
        add_special_tokens=flag(body, "add_special_tokens", not is_chat),
        clamped=clamped,
    )


def _prompt_logprobs(
    body: dict[str, Any], sampling: common_pb2.SamplingParams, *, echo: bool
) -> int | None:
    """vLLM's `prompt_logprobs: N` (returned as its own field); `SamplingParams.
    prompt_logprobs` is the most the answer needs: N, or `logprobs` when echo puts the prompt's
    tokens in the logprobs object (vLLM's rule)."""
    asked = _typed(body, "prompt_logprobs", (int,), "an integer")
    if asked is not None and not 0 <= asked <= MAX_LOGPROBS:
        raise bad_request("prompt_logprobs", f"prompt_logprobs = {asked}: must be in [0, "
                          f"{MAX_LOGPROBS}] (the most likely tokens returned per prompt "
                          "token)")  # fmt: skip
    needed = [n for n in (asked, sampling.logprobs if echo and sampling.HasField("logprobs")
                          else None) if n is not None]  # fmt: skip
    if needed:
        sampling.prompt_logprobs = max(needed)
    return asked
