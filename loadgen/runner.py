"""Drives one run: sends each request at its arrival offset, bounded by `max_concurrency`,
and collects one `RequestRecord` per request. Never raises for a failed request.

As in `vllm bench serve`, the arrival clock is not slowed by the concurrency cap: a request
that arrives while `max_concurrency` requests are in flight waits in FIFO order, and its TTFT
and E2EL are measured from when it is actually sent (the wait shows as `scheduled_s` <
`start_s` in the per-request output).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

from loadgen.arrivals import ArrivalSpec, schedule
from loadgen.client import STATUS_CLIENT_ERROR, RequestRecord, StreamingClient
from loadgen.progress import LiveProgress
from loadgen.workloads import LoadRequest


@dataclass(frozen=True)
class RunResult:
    """Raw outcome of one run, in the order the requests were given."""

    request_rate: float
    max_concurrency: int | None
    records: tuple[RequestRecord, ...]
    run_start_s: float
    duration_s: float


def _client_error_record(request: LoadRequest, exc: BaseException) -> RequestRecord:
    now = time.perf_counter()
    return RequestRecord(
        request_id=request.request_id,
        input_len=request.input_len,
        requested_output_len=request.output_len,
        start_s=now,
        end_s=now,
        status_code=STATUS_CLIENT_ERROR,
        error=f"{type(exc).__name__}: {exc}",
    )


async def _send_one(
    client: StreamingClient,
    request: LoadRequest,
    scheduled_s: float,
    semaphore: asyncio.Semaphore | None,
    progress: LiveProgress | None,
) -> RequestRecord:
    try:
        if semaphore is None:
            record = await client.generate(request, progress)
        else:
            async with semaphore:
                record = await client.generate(request, progress)
    except Exception as exc:  # a buggy client must not sink the whole run
        record = _client_error_record(request, exc)
    record = dataclasses.replace(record, scheduled_s=scheduled_s)
    if progress is not None:
        progress.advance(record.is_success)
    return record


async def run_once(
    client: StreamingClient,
    requests: Sequence[LoadRequest],
    arrivals: ArrivalSpec,
    max_concurrency: int | None = None,
    progress: LiveProgress | None = None,
) -> RunResult:
    """Send `requests` on the schedule from `arrivals`; return when every stream has ended."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    offsets_s = schedule(requests, arrivals)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    tasks: list[asyncio.Task[RequestRecord]] = []
    run_start_s = time.perf_counter()
    try:
        for request, offset_s in zip(requests, offsets_s):
            # A loop: asyncio may wake a timer up to its clock resolution early.
            while (delay_s := run_start_s + offset_s - time.perf_counter()) > 0:
                await asyncio.sleep(delay_s)
            coro = _send_one(client, request, run_start_s + offset_s, semaphore, progress)
            tasks.append(asyncio.create_task(coro, name=f"loadgen-{request.request_id}"))
        records = await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # only non-empty on cancellation: don't leave streams behind
            task.cancel()
    duration_s = time.perf_counter() - run_start_s
    if progress is not None:
        progress.close()
    return RunResult(
        request_rate=arrivals.request_rate,
        max_concurrency=max_concurrency,
        records=tuple(records),
        run_start_s=run_start_s,
        duration_s=duration_s,
    )


async def run_warmups(
    client: StreamingClient, requests: Sequence[LoadRequest], max_concurrency: int | None
) -> tuple[RequestRecord, ...]:
    """Send warm-up requests all at once (bounded by `max_concurrency`); results are only
    returned so the caller can say how many failed, never summarized."""
    burst = ArrivalSpec(request_rate=float("inf"), use_trace_timestamps=False)
    result = await run_once(client, requests, burst, max_concurrency)
    return result.records
