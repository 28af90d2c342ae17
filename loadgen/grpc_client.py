"""`StreamingClient` over gRPC to `dsv4.v1.Router` (router_svc or a colocated engine).

The only loadgen module that touches generated stubs; they are imported lazily so the rest of
loadgen (and its tests) works without them. One channel is shared by all requests; every
request is one `Generate` stream. With `api_key`, each call carries the metadata
`authorization: Bearer KEY`; with `tls_ca_path`, the channel is TLS with that root CA.

Note (docs/architecture.md#platform-notes): a grpc.aio server without raised
`grpc.server.max_pending_requests` cancels calls beyond about 1000 in flight; those come back
here as CANCELLED and are counted, not hidden. Use `--max-concurrency` to stay below it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import ModuleType

from loadgen.client import (
    STATUS_CLIENT_ERROR,
    ClientOptions,
    ModelInfoView,
    RecordBuilder,
    RequestRecord,
    TokenListener,
)
from loadgen.target import (
    LoadtestConfigError,
    check_tcp_reachable,
    not_grpc_message,
    sniff_protocol,
)
from loadgen.workloads import LoadRequest

GENERATE_METHOD = "/dsv4.v1.Router/Generate"
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 30_000),
)


def load_stubs() -> tuple[ModuleType, ModuleType, ModuleType]:
    """(common_pb2, router_pb2, router_pb2_grpc); ImportError says how to generate them."""
    try:
        from dsv4.rpc.v1 import common_pb2, router_pb2, router_pb2_grpc
    except ImportError as exc:
        raise ImportError(
            f"generated gRPC code for dsv4.v1 is missing ({exc}); run `make protos`"
        ) from exc
    return common_pb2, router_pb2, router_pb2_grpc


class GrpcRouterClient:
    """Async client; create it inside the running event loop, `await close()` when done."""

    def __init__(self, options: ClientOptions) -> None:
        import grpc

        from dsv4.wire.common import usage_from_proto

        self._grpc = grpc
        self._usage_from_proto = usage_from_proto
        self._common_pb2, self._router_pb2, router_pb2_grpc = load_stubs()
        self.options = options
        if options.tls_ca_path:
            creds = grpc.ssl_channel_credentials(Path(options.tls_ca_path).read_bytes())
            self._channel = grpc.aio.secure_channel(options.target, creds, CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.insecure_channel(options.target, CHANNEL_OPTIONS)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._metadata = (
            (("authorization", f"Bearer {options.api_key}"),) if options.api_key else ()
        )

    async def close(self) -> None:
        await self._channel.close()

    async def check_reachable(self) -> None:
        """Raise TargetUnreachable unless something accepts TCP connections at the target."""
        await check_tcp_reachable(self.options.target)

    async def _protocol_problem(self, exc: BaseException) -> str:
        """Why an UNAVAILABLE call failed when the target speaks another protocol: HTTP/1 (the
        HTTP front), or plaintext gRPC under --tls-ca; "" otherwise."""
        target = self.options.target
        details = getattr(exc, "details", lambda: "")() or ""
        found = "http1" if "http1.x" in details else await sniff_protocol(target)
        if found == "http1":
            return not_grpc_message(target)
        if found == "http2" and self.options.tls_ca_path:  # TLS servers never answer so
            return f"{target} speaks gRPC without TLS: drop --tls-ca (or give its TLS port)"
        return ""

    async def __aenter__(self) -> GrpcRouterClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def build_request(self, request: LoadRequest):
        """The `GenerateRequest` for `request`: exactly `output_len` new tokens."""
        sampling = self._common_pb2.SamplingParams(
            max_new_tokens=request.output_len, ignore_eos=self.options.ignore_eos
        )
        if self.options.temperature is not None:
            sampling.temperature = self.options.temperature
        msg = self._router_pb2.GenerateRequest(request_id=request.request_id, sampling=sampling)
        if request.prompt_token_ids is not None:
            msg.prompt_token_ids.ids.extend(request.prompt_token_ids)
        else:
            msg.prompt = request.prompt_text or ""
        return msg

    async def generate(
        self, request: LoadRequest, listener: TokenListener | None = None
    ) -> RequestRecord:
        """Stream one request; gRPC errors become a record with the status code name."""
        try:
            message = self.build_request(request)
        except Exception as exc:  # e.g. a token id outside int32
            return RecordBuilder(request).build(STATUS_CLIENT_ERROR, f"bad request: {exc}")
        builder = RecordBuilder(request, listener)  # the clock starts after serialization
        call = None
        try:
            call = self._stub.Generate(
                message,
                timeout=self.options.timeout_s,
                metadata=self._metadata,
            )
            async for msg in call:
                builder.on_message(len(msg.token_ids))
                if msg.finish_reason:
                    name = self._common_pb2.FinishReason.Name(msg.finish_reason)
                    builder.finish_reason = name.removeprefix("FINISH_REASON_").lower()
                if msg.HasField("usage"):
                    builder.usage = self._usage_from_proto(msg.usage)
        except self._grpc.aio.AioRpcError as exc:
            return builder.build(exc.code().name, exc.details() or "")
        except asyncio.CancelledError:
            if call is not None:
                call.cancel()
            raise
        except Exception as exc:
            return builder.build(STATUS_CLIENT_ERROR, f"{type(exc).__name__}: {exc}")
        return builder.build()

    async def fetch_model_info(self) -> ModelInfoView | None:
        """The server's ModelInfo, or None when the call fails (older server, no access).
        Raises LoadtestConfigError when the target speaks another protocol."""
        try:
            info = await self._stub.GetModelInfo(
                self._router_pb2.GetModelInfoRequest(),
                timeout=self.options.timeout_s or 10.0,
                metadata=self._metadata,
            )
        except self._grpc.aio.AioRpcError as exc:
            unavailable = exc.code() == self._grpc.StatusCode.UNAVAILABLE
            if unavailable and (problem := await self._protocol_problem(exc)):
                raise LoadtestConfigError(problem) from None
            return None
        return ModelInfoView(
            model_name=info.model_name,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            speculative_method=info.speculative_method,
        )
