"""The prefill leg of one request: choose (P, D), call P.Prefill, retry on another P.

A retry happens when P answers UNAVAILABLE, CANCELLED (it is shutting down) or
RESOURCE_EXHAUSTED (`clients.RETRIABLE_CODES`; any other status is the request's own fault and
goes back to the client at once), when this attempt's `prefill_timeout_s` runs out while the request still
has time (P is stuck), or when the pool marks P down mid-call; at most `max_prefill_retries`
times, never on a P that already failed this request. UNAVAILABLE-like failures also make the
pool probe P at once. When no prefill pool can serve, a colocated worker is returned instead.
Called by `RequestFlow` on the event loop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import grpc

from dsv4.errors import Unavailable
from dsv4.types import GenerateRequest, PrefillResult
from router_svc.accounting import RequestAccount
from router_svc.choice import choose_route
from router_svc.clients import CallInterrupted, WorkerCallError
from router_svc.deadline import Deadline
from router_svc.flow_settings import FlowDeps
from router_svc.live import ActiveCall
from router_svc.view import WorkerView

logger = logging.getLogger(__name__)


@dataclass
class Exclusions:
    """Workers (by address) that already failed this request."""

    prefill: set[str] = field(default_factory=set)
    decode: set[str] = field(default_factory=set)


async def run_prefill_leg(
    request: GenerateRequest,
    *,
    deps: FlowDeps,
    deadline: Deadline,
    active: ActiveCall,
    excluded: Exclusions,
    account: RequestAccount,
) -> tuple[WorkerView, PrefillResult | None]:
    """(the P that answered and its result) or (a colocated worker, None). Raises Unavailable
    when no route is left, DeadlineExceeded, or the mapped error of a non-retryable answer."""
    pool, settings = deps.pool, deps.settings
    while True:
        active.check_aborted()
        route = choose_route(
            pool.snapshot(), exclude_prefill=excluded.prefill, exclude_decode=excluded.decode
        )
        if route.prefill is None:
            return route.decode, None
        prefill = route.prefill
        timeout_s = deadline.call_timeout_s(time.monotonic(), settings.prefill_timeout_s)
        pool.note_dispatch(prefill.address, request)
        active.call = deps.clients.start_prefill(prefill.address, request, timeout_s)
        try:
            result = await active.call.result()
        except WorkerCallError as exc:
            if not _may_retry(exc, deadline):
                raise exc.to_dsv4_error() from exc
            if exc.code is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                pool.report_suspect(prefill.address)
            reason = str(exc)
        except CallInterrupted as exc:
            active.check_aborted()
            reason = exc.reason
        else:
            account.on_prefill(result, prefill.worker_id)
            return prefill, result
        finally:
            active.call = None
        excluded.prefill.add(prefill.address)
        account.num_prefill_retries += 1
        deps.metrics.prefill_retries.inc()
        logger.info("prefill on %s failed (%s): retrying elsewhere", prefill.worker_id, reason)
        if account.num_prefill_retries > settings.max_prefill_retries:
            raise Unavailable(
                f"prefill failed on {account.num_prefill_retries} workers (router."
                f"max_prefill_retries = {settings.max_prefill_retries}); last: {reason}"
            )


def _may_retry(exc: WorkerCallError, deadline: Deadline) -> bool:
    if exc.code is grpc.StatusCode.DEADLINE_EXCEEDED:
        if deadline.remaining_s(time.monotonic()) <= 0:
            raise deadline.exceeded() from exc
        return True  # this attempt's prefill_timeout_s ran out: P is stuck or overloaded
    return exc.is_retriable
