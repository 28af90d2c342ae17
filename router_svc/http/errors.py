"""The HTTP front's errors: `ApiError`, what every refusal and failure becomes.

`ApiError(status, message, param, code)` is rendered as `{"error": {"message", "type", "param",
"code"}}`, the OpenAI error object; `bad_request` is the 400 naming a parameter, and `shown`
writes a value into its message. The router's gRPC status (`api_error`: a Dsv4Error, or
`ApiError.from_grpc`: a code name and message) maps through `HTTP_STATUS`, its message
naming the OpenAI parameter where the router's validation named a proto field. `openai_errors`
(the app's middleware) answers every refusal with an error object, aiohttp's own 404 / 405 / 413
included, and `ServerLog` logs a request aiohttp could not parse as the client's fault.
Kept apart from request parsing (protocol.py) and routing (app.py): the body reader, the
in-process call, the choices and /tokenize raise these too.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from dsv4.errors import to_grpc_status

logger = logging.getLogger(__name__)

HTTP_STATUS = {
    "INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429, "CANCELLED": 499, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
}  # fmt: skip
ERROR_TYPE = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable_error",
    504: "timeout_error",
}  # fmt: skip
# The router's validation names proto fields; the client sent OpenAI ones.
_PARAM_OF_FIELD = {
    "sampling.max_new_tokens": "max_tokens", "sampling.temperature": "temperature",
    "sampling.top_p": "top_p", "sampling.top_k": "top_k", "sampling.stop_token_ids":
    "stop_token_ids", "sampling.stop": "stop", "prompt": "prompt", "prompt_token_ids": "prompt",
    "request_id": "X-Request-Id", "sampling.presence_penalty": "presence_penalty",
    "sampling.frequency_penalty": "frequency_penalty",
    "sampling.repetition_penalty": "repetition_penalty", "sampling.logit_bias": "logit_bias",
    "sampling.logprobs": "logprobs", "sampling.prompt_logprobs": "prompt_logprobs",
}  # fmt: skip
_FIELD_AT_START = re.compile(r"(sampling\.\w+|prompt_token_ids|prompt|request_id)\b")


class ApiError(Exception):
    """An error answered as an OpenAI error object with HTTP `status`."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code, self.retry_after_s = code, retry_after_s

    @classmethod
    def from_grpc(cls, code_name: str, message: str, retry_after_s: float | None = None):
        """The router's status (a grpc.StatusCode name) as the HTTP error a client expects."""
        match = _FIELD_AT_START.match(message)
        param = _PARAM_OF_FIELD.get(match.group(1)) if match else None
        if match and param:  # "sampling.max_new_tokens = 0: ..." -> "max_tokens = 0: ..."
            message = param + message[match.end() :]
        status = HTTP_STATUS.get(code_name, 500)
        return cls(
            status, message, param=param, code=code_name.lower(), retry_after_s=retry_after_s
        )

    def body(self) -> dict[str, Any]:
        client_fault = 400 <= self.status < 500
        kind = ERROR_TYPE.get(
            self.status, "invalid_request_error" if client_fault else "server_error"
        )
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return {"error": error}


def bad_request(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_argument")


def shown(value: Any) -> str:
    """A value for an error message: short, and never a walk of a (deep) list or object."""
    if isinstance(value, list | dict):
        return "[...]" if isinstance(value, list) else "{...}"
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def error_response(exc: ApiError) -> web.Response:
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, int(exc.retry_after_s)))
    response = web.json_response(exc.body(), status=exc.status, headers=headers)
    if exc.status == 408:  # the body's rest may still come: never read it as the next request
        response.force_close()
    return response


def api_error(exc: BaseException) -> ApiError:
    code, message = to_grpc_status(exc)
    return ApiError.from_grpc(code.name, message, getattr(exc, "retry_after_s", None))


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every refusal as an OpenAI error object, aiohttp's own 404 / 405 / 413 included."""
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 413:  # aiohttp's text names the size, not the setting that sets it
            return error_response(ApiError(413, f"{(exc.text or exc.reason).rstrip('.')} "
                                           "(router.max_message_bytes): send a smaller body",
                                           param="body"))  # fmt: skip
        return error_response(
            ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}")
        )
    except Exception as exc:  # a bug: still an error object, and a traceback in the log
        logger.exception("HTTP %s %s failed", request.method, request.path)
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))


class ServerLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server logger for this front: a request it could not parse (a header line
    too long, a bad character, a broken chunk) is the client's fault, answered 400 by aiohttp,
    and logged as one WARNING line, not an ERROR with a traceback any client could fill the
    log with; every other exception keeps its traceback."""

    def exception(self, msg: object, *args: Any, exc_info: Any = True, **kw: Any) -> None:
        if isinstance(exc_info, HttpProcessingError) and 400 <= (exc_info.code or 0) < 500:
            message = " ".join(str(exc_info.message).split())[:200]
            said = str(msg) % args if args else str(msg)  # "Error handling request from PEER"
            self.warning("%s: answered %d: %s", said, exc_info.code, message)
            return
        self.logger.exception(msg, *args, exc_info=exc_info, **kw)
