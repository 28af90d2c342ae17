"""A request body -> JSON, bounded: its read in time, its decoding, its walk in memory.

`read_json` reads the body within a time limit (a client that announced more bytes than it
sends gets 408 with `Connection: close`, and aiohttp closes the connection after reading what
still comes for its lingering time, 10 s: no handler is held forever), decodes it
with its charset and parses it; every way a body can fail to be JSON this server takes
(invalid syntax, a bad charset, nesting deeper than the parser's stack, an integer beyond
Python's digit limit) is a 400 with one line naming it. `check_unicode` refuses lone UTF-16
surrogates, walking the decoded body without recursion and in memory bounded by its depth.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from router_svc.http.errors import ApiError, bad_request

# No router setting holds it (router.* lives in dsv4/config): a body of router.max_message_bytes
# (16 MiB by default) arrives in well under this on any link a serving client uses.
BODY_READ_TIMEOUT_S = 30.0
_SURROGATE = re.compile("[\ud800-\udfff]")


async def read_json(request: web.Request, timeout_s: float = BODY_READ_TIMEOUT_S) -> Any:
    """The request body, parsed; ApiError(408) when it does not arrive within `timeout_s`,
    ApiError(400) when it is not JSON."""
    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except TimeoutError as exc:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s (sent "
                       "fewer bytes than Content-Length?)", param="body",
                       code="request_timeout") from exc  # fmt: skip
    charset = request.charset or "utf-8"
    try:
        text = raw.decode(charset)
    except LookupError as exc:
        raise bad_request("body", f"charset {charset!r} is unknown: send JSON as UTF-8") from exc
    except UnicodeDecodeError as exc:
        raise bad_request("body", f"the request body is not valid {charset} text: {exc}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_request("body", f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise bad_request("body", "the request body is not valid JSON here: it is nested too "
                          "deeply") from exc  # fmt: skip
    except ValueError as exc:  # int(): more digits than sys.get_int_max_str_digits()
        raise bad_request("body", "the request body is not valid JSON here: a number in it is "
                          "too large") from exc  # fmt: skip


def check_unicode(body: Any) -> None:
    """JSON's `\\ud800` escapes decode to lone UTF-16 surrogates, which no UTF-8 text (the
    tokenizer's, protobuf's) can hold: refuse them here, naming where, instead of failing deep
    inside. Walks the decoded body depth-first with a stack of iterators (any depth json.loads
    accepted, memory bounded by the depth; a path is only spelled out for the error)."""
    stack: list[tuple[str | int, Iterator[tuple[str | int, Any]]]] = [("", _items(body))]
    while stack:
        item = next(stack[-1][1], None)
        if item is None:
            stack.pop()
            continue
        key, value = item
        if isinstance(value, str) and (found := _SURROGATE.search(value)):
            path = [k for k, _ in stack[1:]] + [key]
            raise bad_request(_param(path), f"{_spelled(path)} holds a lone UTF-16 surrogate "
                              f"(U+{ord(found.group()):04X}) at character {found.start()}: "
                              "send valid Unicode text")  # fmt: skip
        if isinstance(value, dict | list):
            stack.append((key, _items(value)))


def _items(value: Any) -> Iterator[tuple[str | int, Any]]:
    if isinstance(value, dict):
        return iter(value.items())
    if isinstance(value, list):
        return enumerate(value)
    return iter((("body", value),))  # a bare value: itself


def _param(path: list[str | int]) -> str:
    return path[0] if isinstance(path[0], str) else "body"


def _spelled(path: list[str | int]) -> str:
    """["stop", 0] -> "stop[0]", ["messages", 1, "content"] -> "messages[1].content"."""
    out = "" if isinstance(path[0], str) else "body"
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else f".{key}" if out else key
    return out
