"""`MalformedMessageInterceptor`: a request that does not parse is INVALID_ARGUMENT, not UNKNOWN.

grpc answers UNKNOWN ("Unexpected DecodeError") when a request's bytes are not a valid message
of the method's type: truncated or garbage bytes, or a `string` field holding invalid UTF-8
(proto3 requires UTF-8). That is the caller's error, so every dsv4 server (router and workers)
installs this interceptor: it wraps each handler's deserializer so a parse failure reaches the
method as a marker, and the wrapped method ends the call with INVALID_ARGUMENT and a message
saying what to fix. Unary-unary and unary-stream methods are covered (all dsv4 methods are
one of those); other kinds pass through unchanged. Runs on the server's event loop.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class _Malformed:
    def __init__(self, reason: str) -> None:
        self.reason = reason


def _safe(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        if deserialize is None:
            return data
        try:
            return deserialize(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as exc:
            return _Malformed(str(exc))

    return parse


async def _refuse(context: grpc.aio.ServicerContext, method: str, request: _Malformed) -> None:
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{method}: the request is not a valid protobuf message ({request.reason}): send a "
        "message built from the dsv4.v1 protos; string fields must be valid UTF-8",
    )


def guard_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """The same handler, with malformed requests answered INVALID_ARGUMENT."""
    if handler.request_streaming:
        return handler
    deserialize, serialize = _safe(handler.request_deserializer), handler.response_serializer
    if not handler.response_streaming:
        unary = handler.unary_unary

        async def unary_behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await _refuse(context, method, request)
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_behavior, deserialize, serialize)
    stream = handler.unary_stream
    if inspect.isasyncgenfunction(stream):

        async def generator_behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await _refuse(context, method, request)
            async for response in stream(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(generator_behavior, deserialize, serialize)

    async def writer_behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            await _refuse(context, method, request)
        return await stream(request, context)  # the method writes with context.write

    return grpc.unary_stream_rpc_method_handler(writer_behavior, deserialize, serialize)


class MalformedMessageInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        return guard_handler(handler, details.method)
