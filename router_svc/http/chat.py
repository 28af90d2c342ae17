"""Chat messages -> one prompt string: the checkpoint's chat template, or DeepSeek-V4's format.

The template is the checkpoint's `chat_template.jinja`, else `chat_template` in its
`tokenizer_config.json` (a string, or a list of {name, template} where "default" is used),
rendered as transformers' `apply_chat_template` does: a sandboxed jinja2 environment with
`trim_blocks`, `lstrip_blocks` and loop controls, its `tojson` (no HTML escaping),
`raise_exception` and `strftime_now`, and the variables `messages`, `tools`, `documents`,
`add_generation_prompt` and the special tokens (`bos_token`, `eos_token`, ...).

Without a template: DeepSeek-V4's own encoding in chat (non-thinking) mode,
`BOS system <｜User｜>user<｜Assistant｜></think>answer EOS <｜User｜>...<｜Assistant｜></think>`,
with BOS and EOS spelled as the tokenizer spells ids bos/eos (`<｜begin▁of▁sentence｜>` in the
real tokenizer, `<bos>` in the tiny one), so BOS is always one token. The rendered text is
tokenized without adding special tokens: the template already wrote them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dsv4.config import ModelSection
from dsv4.errors import CheckpointError, InvalidRequest
from router_svc.text_model import TextModel

logger = logging.getLogger(__name__)

USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
THINKING_END_TOKEN = "</think>"
# DeepSeek-V4's encoding (chat mode) as a template: system text right after BOS, a user turn
# opens with USER and hands over with ASSISTANT + </think>, an assistant turn ends with EOS.
# `developer` renders as a user turn, as in DeepSeek's reference encoder.
DEEPSEEK_V4_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}{{ m.content }}"
    "{% elif m.role in ('user', 'developer') %}" + USER_TOKEN + "{{ m.content }}"
    "{% if (loop.last and add_generation_prompt) or (not loop.last and "
    "messages[loop.index0 + 1].role == 'assistant') %}"
    + ASSISTANT_TOKEN
    + THINKING_END_TOKEN
    + "{% endif %}"
    "{% elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
    "{% else %}{{ raise_exception('role ' ~ m.role ~ ' is not supported: use system, user, "
    "assistant or developer') }}"
    "{% endif %}"
    "{% endfor %}"
)
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                       "mask_token")  # fmt: skip


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
    sort_keys: bool = False,
) -> str:  # fmt: skip
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def compile_template(source: str) -> jinja2.Template:
    """A chat template compiled the way transformers compiles it (sandboxed)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


@dataclass(frozen=True)
class ChatTemplate:
    """Built once by the HTTP front; `render(messages)` is pure."""

    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    origin: str = "deepseek-v4"  # for logs: the file the template came from

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "_compiled", compile_template(self.source))
        except jinja2.TemplateError as exc:
            raise CheckpointError(
                f"the chat template of {self.origin} does not parse: {exc}"
            ) from exc

    def render(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
        variables: Mapping[str, Any] | None = None,
    ) -> str:  # fmt: skip
        """The prompt for `messages` (with the assistant's turn opened unless
        `add_generation_prompt` is off); `variables`: more for the template, which may set its
        own (a request's chat_template_kwargs, as vLLM passes them). InvalidRequest when the
        template refuses the conversation (raise_exception) or fails on it."""
        values = {"tools": None, "documents": None, "add_generation_prompt": add_generation_prompt,
                  **self.special_tokens, **(variables or {}), "messages": messages}  # fmt: skip
        try:
            return self._compiled.render(values)  # type: ignore[attr-defined]
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"messages: the chat template refused them: {exc}") from exc
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError,
                RecursionError) as exc:  # fmt: skip
            # the request's values (deep, odd types) through the template: still its input
            raise InvalidRequest(f"messages: the chat template failed on them: {exc}") from exc


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or a serialized AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} does not parse as JSON: {exc}") from exc
    return raw if isinstance(raw, dict) else {}


def _template_source(directory: Path, config: dict[str, Any]) -> tuple[str, str] | None:
    jinja_path = directory / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(), str(jinja_path)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template, str(directory / "tokenizer_config.json")
    return None


def tokenizer_dir(model: ModelSection) -> Path | None:
    """Where tokenizer_config.json would sit: beside the configured tokenizer, else the
    checkpoint directory; None for the tiny model without a directory."""
    if model.tokenizer:
        path = Path(model.tokenizer)
        return path if path.is_dir() else path.parent
    return Path(model.model_dir) if model.model_dir else None


def load_chat_template(model: ModelSection, text: TextModel) -> ChatTemplate:
    """The checkpoint's template, or DeepSeek-V4's format; raises CheckpointError when a
    template is there but broken."""
    directory = tokenizer_dir(model)
    config = _read_config(directory) if directory is not None and directory.is_dir() else {}
    tokens = {k: t for k in _SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
    codec = text.codec
    for key, token_id in (("bos_token", text.bos_token_id), ("eos_token", text.eos_token_id)):
        if key not in tokens and codec is not None:
            tokens[key] = codec.token_text(token_id) or ""
    found = _template_source(directory, config) if directory is not None else None
    if found is None:
        return ChatTemplate(DEEPSEEK_V4_TEMPLATE, tokens)
    source, origin = found
    logger.info("router: chat template from %s", origin)
    return ChatTemplate(source, tokens, origin)
