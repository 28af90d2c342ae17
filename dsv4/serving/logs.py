"""Log lines of every service: text or JSON, each carrying the request id and the worker id.

The request id lives in a contextvar (`request_id_var`), set by each servicer at the entry of a
call (`bind_request_id`). grpc.aio runs every call in its own task, and tasks spawned from it
copy the context, so every line logged on behalf of a request, on the router, on P and on D,
carries that request's id; lines from elsewhere (engine thread, probes) carry "". The id also
travels between services as gRPC metadata `x-request-id` (besides the request protos).

`configure_logging(level, log_format, worker_id)` (once per process, from `dsv4 prefill|decode|
router`) installs one stderr handler on the root logger:
- text: `2025-01-01 12:00:00,123 INFO router_svc.flow [req=abc worker=router]: message`
- json: one object per line with ts (ISO 8601 UTC), level, logger, msg, request_id, worker_id
  (and exc when an exception is attached).
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import re
import sys
from collections.abc import Iterable

REQUEST_ID_METADATA_KEY = "x-request-id"
MAX_LOGGED_ID_CHARS = 128
_UNSAFE = re.compile(r"[^A-Za-z0-9._:/=+@#-]")

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("dsv4_request_id", default="")
_worker_id = ""


def bind_request_id(
    request_id: str, metadata: Iterable[tuple[str, str | bytes]] | None = None
) -> None:
    """Tag every log line of the current call (task) with `request_id`, or with the caller's
    `x-request-id` metadata when the id is empty. An id from a client is cut to 128 characters
    and characters outside the request-id alphabet become "?", so it cannot forge log lines."""
    request_id = request_id or request_id_from_metadata(metadata)
    request_id_var.set(_UNSAFE.sub("?", request_id[:MAX_LOGGED_ID_CHARS]))


def request_id_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    for key, value in metadata or ():
        if key == REQUEST_ID_METADATA_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


def request_metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    """The metadata that carries `request_id` to the next service (empty id: nothing)."""
    return ((REQUEST_ID_METADATA_KEY, request_id),) if request_id else ()


def set_worker_id(worker_id: str) -> None:
    """The process' name in logs (a worker's id, or "router-host:port")."""
    global _worker_id
    _worker_id = worker_id


class ContextFilter(logging.Filter):
    """Adds `request_id` and `worker_id` to every record (for both formatters)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        record.worker_id = _worker_id
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "request_id": getattr(record, "request_id", ""),
            "worker_id": getattr(record, "worker_id", ""),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [req=%(request_id)s worker=%(worker_id)s]: %(message)s"  # fmt: skip


def configure_logging(level: str, log_format: str, worker_id: str = "") -> None:
    """Replace the root logger's handlers with one stderr handler in `log_format`."""
    set_worker_id(worker_id)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter())
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
