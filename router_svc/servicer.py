"""`dsv4.v1.Router` servicer: the boundary where protos become dataclasses and errors become
gRPC statuses (always through `dsv4.errors.to_grpc_status`).

Per Generate call, on the server's event loop: API key -> rate limit -> admission -> limits
from the pool's Info answers -> prompt bytes, bounded tokenizing, validation (`intake`,
`dsv4.wire`) -> deadline -> `RequestFlow`, whose chunks are written as they come. RESOURCE_EXHAUSTED answers carry the standard
`grpc-retry-pushback-ms` trailer besides the hint in the message.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from contextlib import aclosing

import grpc

from dsv4 import wire
from dsv4.config import ServeConfig, request_limits
from dsv4.errors import Dsv4Error, Unavailable, to_grpc_status
from dsv4.rpc.v1 import router_pb2, router_pb2_grpc
from dsv4.serving.logs import bind_request_id
from dsv4.types import GenerateRequest, ModelInfo, RequestLimits, WorkerRole
from router_svc.admission import (
    AdmissionGate,
    AdmissionTicket,
    TokenBucketLimiter,
    check_api_key,
    client_key,
)
from router_svc.choice import explain_no_route
from router_svc.deadline import Deadline
from router_svc.flow import RequestFlow
from router_svc.flow_settings import FlowDeps
from router_svc.intake import (
    INLINE_PROMPT_CHARS,
    TokenizerPool,
    check_prompt_bytes,
    normalize_sampling,
)
from router_svc.live import LiveRequests
from router_svc.observe import StreamObserver

logger = logging.getLogger(__name__)

RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"
DEADLINE_SLACK_S = 0.01  # a cancellation this close to the deadline is the deadline's


def _set_error(context: grpc.aio.ServicerContext, exc: BaseException) -> tuple[str, str]:
    """End the call with `exc`'s status; returns (code name, message) for the metrics."""
    code, message = to_grpc_status(exc)
    context.set_code(code)
    context.set_details(message)
    retry_after_s = getattr(exc, "retry_after_s", None)
    if retry_after_s is not None:
        pushback_ms = str(max(1, math.ceil(retry_after_s * 1000)))
        context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, pushback_ms),))
    return code.name, message


def _deadline_passed(context: grpc.aio.ServicerContext) -> bool:
    """Whether the call's own deadline is what ended it: gRPC cancels a handler whose client
    deadline passed just as it does one whose client left, and the two are told apart here."""
    try:
        remaining_s = context.time_remaining()
    except Exception:  # a context that cannot tell
        return False
    return remaining_s is not None and remaining_s <= DEADLINE_SLACK_S


def _owner(api_key: str | None) -> str | None:
    """Who may Abort a request: its API key's digest bucket; None when keys are off."""
    return client_key(api_key, "") if api_key else None


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Built by RouterServer; every method runs on the server's event loop."""

    def __init__(
        self,
        cfg: ServeConfig,
        deps: FlowDeps,
        live: LiveRequests,
        gate: AdmissionGate,
        limiter: TokenBucketLimiter,
        tokenizer_pool: TokenizerPool | None = None,
    ) -> None:
        self._cfg, self._deps, self._live = cfg, deps, live
        self._gate, self._limiter = gate, limiter
        self._tokenizer_pool = tokenizer_pool or TokenizerPool(deps.text.encode)
        self._metrics = deps.metrics

    @property
    def gate(self) -> AdmissionGate:
        return self._gate

    @property
    def limiter(self) -> TokenBucketLimiter:
        return self._limiter

    @property
    def tokenizer_pool(self) -> TokenizerPool:
        """The bounded pool long prompts are tokenized in (the HTTP front's /tokenize too)."""
        return self._tokenizer_pool

    # ---- Generate -----------------------------------------------------------------------------

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        received_at_s = time.monotonic()
        observer = StreamObserver(self._metrics, received_at_s)
        code, details = "CANCELLED", "the client went away"
        try:
            code, details = await self._generate(request, context, observer, received_at_s)
        finally:
            if code == "CANCELLED" and _deadline_passed(context):  # gRPC ended the call
                code, details = "DEADLINE_EXCEEDED", "the client's gRPC deadline passed"
            observer.finish(code, details)

    async def _generate(
        self,
        request: router_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext,
        observer: StreamObserver,
        received_at_s: float,
    ) -> tuple[str, str]:
        """Serve one Generate call; returns its final (status code name, details)."""
        bind_request_id(request.request_id)  # the client's id (sanitized) until validated
        try:
            ticket, owner = self._admit(context)
        except Dsv4Error as exc:
            return _set_error(context, exc)
        with ticket:
            try:
                deadline = self._deadline(context)
                validated = await self._validate(request, deadline)
                bind_request_id(validated.request_id)
                if getattr(context, "counts_prompt", True):  # False: another choice's prompt
                    self._metrics.prompt_tokens.inc(validated.num_prompt_tokens)
                flow = RequestFlow(validated, deadline, self._deps, received_at_s)
                self._live.add(flow, owner)
            except Dsv4Error as exc:
                return _set_error(context, exc)
            try:
                async with aclosing(flow.run()) as chunks:
                    async for chunk in chunks:
                        await context.write(wire.generate_response_to_proto(chunk))
                        observer.on_chunk(chunk)
            except Dsv4Error as exc:
                return _set_error(context, exc)
            except Exception as exc:
                logger.exception("unexpected error")
                return _set_error(context, exc)
            finally:
                self._live.remove(flow)
        return "OK", ""

    def charge_rate_limit(self, metadata: Sequence[tuple[str, str]], peer: str, cost: int) -> None:
        """Take `cost` requests from the caller's rate limit at once: the HTTP front's choices
        of one request, whose in-process calls then skip it (`rate_limit_paid`), so a request
        of n choices is never refused after some of them took their share."""
        api_key = check_api_key(metadata, self._cfg.router.api_keys)
        try:
            self._limiter.acquire(client_key(api_key, peer), cost)
        except Dsv4Error:
            self._metrics.rejections.labels(reason="rate_limit").inc()
            raise

    def _admit(self, context: grpc.aio.ServicerContext) -> tuple[AdmissionTicket, str | None]:
        """(the admission slot, the request's owner for Abort: its key's bucket or None)."""
        reason = "api_key"
        try:
            api_key = check_api_key(context.invocation_metadata() or (), self._cfg.router.api_keys)
            reason = "rate_limit"
            if not getattr(context, "rate_limit_paid", False):  # only in-process calls have it
                self._limiter.acquire(client_key(api_key, context.peer() or ""))
            reason = "max_inflight"
            return self._gate.admit(), _owner(api_key)
        except Dsv4Error:
            self._metrics.rejections.labels(reason=reason).inc()
            raise

    def _limits(self) -> RequestLimits:
        snapshot = self._deps.pool.snapshot()
        facts = snapshot.model_facts()
        if facts is None:
            raise Unavailable(
                "no worker has reported its model limits yet: "
                + explain_no_route(snapshot, frozenset(), frozenset())
            )
        max_model_len = facts.max_model_len or self._cfg.model.max_model_len
        if self._cfg.model.max_model_len:
            max_model_len = min(max_model_len, self._cfg.model.max_model_len)
        return request_limits(self._cfg, vocab_size=facts.vocab_size, max_model_len=max_model_len)

    async def _validate(
        self, request: router_pb2.GenerateRequest, deadline: Deadline
    ) -> GenerateRequest:
        """Bounded work first (intake.py): the prompt's bytes are checked before any
        tokenizing, and long prompts are tokenized in the bounded pool, off the event loop."""
        limits = self._limits()
        text = self._deps.text
        special = not request.HasField("add_special_tokens") or request.add_special_tokens
        tokenize = (lambda t: text.encode(t, special)) if text.codec is not None else None
        if tokenize is not None and request.WhichOneof("input") == "prompt":
            check_prompt_bytes(request.prompt, limits.max_model_len, text.max_token_bytes)
            if len(request.prompt) > INLINE_PROMPT_CHARS:
                ids = await self._tokenizer_pool.encode(request.prompt, special)
                tokenize = lambda _text: ids  # noqa: E731
        validated = wire.generate_request_from_proto(
            request, limits, tokenize=tokenize, deadline_unix_ms=deadline.expires_at_unix_ms
        )
        return normalize_sampling(validated, limits.vocab_size)

    def _deadline(self, context: grpc.aio.ServicerContext) -> Deadline:
        return Deadline.start(
            config_timeout_s=self._cfg.router.request_timeout_s,
            client_remaining_s=context.time_remaining(),
            now_s=time.monotonic(),
            now_unix_s=time.time(),
        )

    # ---- Abort, GetModelInfo ------------------------------------------------------------------

    async def Abort(self, request, context: grpc.aio.ServicerContext):
        try:
            api_key = check_api_key(context.invocation_metadata() or (), self._cfg.router.api_keys)
            request_id = wire.abort_request_from_proto(request)
        except Dsv4Error as exc:
            self._count("Abort", _set_error(context, exc)[0])
            return wire.abort_response_to_proto(False)
        bind_request_id(request_id)
        was_found = self._live.abort(request_id, _owner(api_key))
        logger.info("Abort: %s", "stopping the request" if was_found else "not running here")
        self._count("Abort", "OK")
        return wire.abort_response_to_proto(was_found)

    async def GetModelInfo(self, request, context: grpc.aio.ServicerContext):
        try:
            check_api_key(context.invocation_metadata() or (), self._cfg.router.api_keys)
            info = self.model_info()
        except Dsv4Error as exc:
            self._count("GetModelInfo", _set_error(context, exc)[0])
            return router_pb2.ModelInfo()
        self._count("GetModelInfo", "OK")
        return wire.model_info_to_proto(info)

    def _count(self, method: str, code: str) -> None:
        self._metrics.requests.labels(method=method, code=code).inc()

    def model_info(self) -> ModelInfo:
        """What GetModelInfo answers; raises Unavailable when no worker has reported yet."""
        limits = self._limits()
        snapshot = self._deps.pool.snapshot()
        facts = snapshot.model_facts()
        text = self._deps.text
        return ModelInfo(
            model_name=facts.model_name if facts else "",
            vocab_size=limits.vocab_size,
            max_model_len=limits.max_model_len,
            max_new_tokens_limit=limits.effective_max_new_tokens,
            eos_token_id=text.eos_token_id,
            bos_token_id=text.bos_token_id,
            num_prefill_workers=len(snapshot.routable(WorkerRole.PREFILL)),
            num_decode_workers=len(snapshot.routable(WorkerRole.DECODE))
            + len(snapshot.routable(WorkerRole.COLOCATED)),
            speculative_method=facts.speculative_method if facts else "unknown",
        )
