"""Several choices in one OpenAI request: `n` > 1, or a batch of prompts on /v1/completions.

Choice `k * n + i` is prompt k's i-th; each is its own in-process Generate call (`call.py`)
with request id `{id}-{k * n + i}`. With a `seed`, a prompt's choice i samples with seed + i,
so its choices differ, each reproduces, and a prompt's first choice is what the same request
alone would answer (greedy choices are equal, as in vLLM). A request of c choices counts c:
the client's rate limit is charged for all c at once before any starts (all or none), then
every call passes admission on its own; more choices than the router admits at once is a 400
(app.py), since no retry could pass. The HTTP status is decided once
every choice has its first chunk: an error before that is the request's status, and the other
choices are cancelled (their blocks freed, as for a client that left). The whole answer lists
the choices by index; its usage counts each prompt once and every choice's tokens, and so
does `vllm:prompt_tokens_total` (a prompt's later choices are calls made with `counts_prompt`
off, app.py), as vLLM counts a request's prompt once. A stream
interleaves the choices' chunks as they come, each with its index, then (with
`include_usage`) one usage chunk; an error after the first chunks ends it with one error
event, the other choices cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from typing import Any, TypeVar

from dsv4.rpc.v1 import router_pb2
from dsv4.types import StreamChunk
from router_svc.http.errors import ApiError
from router_svc.http.protocol import OpenAIRequest
from router_svc.http.responses import Reply, sse_event, usage_object

T = TypeVar("T")
SEED_MODULUS = 2**64  # SamplingParams.seed is a uint64


def choice_protos(
    parsed: OpenAIRequest, prompts: Sequence[str | tuple[int, ...]], request_id: str
) -> list[router_pb2.GenerateRequest]:
    """One Generate request per choice, prompt by prompt: ids `{request_id}-{index}`, a
    prompt's choice i seeded seed + i when seeded."""
    protos = []
    for k, prompt in enumerate(prompts):
        for i in range(parsed.n):
            msg = parsed.to_proto(prompt, f"{request_id}-{k * parsed.n + i}")
            if msg.sampling.HasField("seed"):
                msg.sampling.seed = (msg.sampling.seed + i) % SEED_MODULUS
            protos.append(msg)
    return protos


async def all_or_none(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Await them together; the first failure cancels the rest and is raised once they ended
    (so no stream is still being read when the caller closes it)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def first_chunks(streams: Sequence[AsyncIterator[StreamChunk]]) -> list[StreamChunk]:
    """Every choice's first chunk; raises the first error (the request's HTTP status)."""
    firsts = await all_or_none(anext(s, None) for s in streams)
    if any(first is None for first in firsts):
        raise ApiError(500, "a choice ended without output", code="internal")
    return firsts  # type: ignore[return-value]


def merged_usage(replies: Sequence[Reply], n: int) -> dict[str, int]:
    """Each prompt's tokens once (its choices are n in a row), every choice's completion."""
    per_choice = [usage_object(r.usage, r.num_tokens) for r in replies]
    prompt = sum(u["prompt_tokens"] for u in per_choice[::n])
    completion = sum(u["completion_tokens"] for u in per_choice)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


async def whole_answer(
    replies: Sequence[Reply], firsts: Sequence[StreamChunk],
    streams: Sequence[AsyncIterator[StreamChunk]], n: int,
) -> dict[str, Any]:  # fmt: skip
    """The non-streaming answer: every choice read to its end, concurrently."""

    async def drain(reply: Reply, first: StreamChunk, stream: AsyncIterator[StreamChunk]) -> None:
        reply.add(first)
        async for chunk in stream:
            reply.add(chunk)

    await all_or_none(drain(*args) for args in zip(replies, firsts, streams))
    head = replies[0].whole()
    return {**head, "choices": [r.choice() for r in replies], "usage": merged_usage(replies, n)}


async def merged_events(
    replies: Sequence[Reply], firsts: Sequence[StreamChunk],
    streams: Sequence[AsyncIterator[StreamChunk]], n: int,
) -> AsyncIterator[bytes]:  # fmt: skip
    """SSE events of every choice as their chunks arrive; raises a choice's ApiError. A bounded
    queue keeps the in-process calls' backpressure: a slow client slows the choices."""
    for reply, first in zip(replies, firsts):
        for event in reply.stream_events(first):
            yield event
    queue: asyncio.Queue[tuple[int, StreamChunk | BaseException | None]] = asyncio.Queue(
        maxsize=4 * len(replies)
    )

    async def pump(index: int, stream: AsyncIterator[StreamChunk]) -> None:
        try:
            async for chunk in stream:
                await queue.put((index, chunk))
        except Exception as exc:  # the consumer raises it (ApiError: an error event)
            await queue.put((index, exc))
        await queue.put((index, None))

    open_ = [i for i, r in enumerate(replies) if r.finish_reason is None]
    tasks = [asyncio.create_task(pump(i, streams[i]), name=f"choice {i}") for i in open_]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                for event in replies[index].stream_events(item):
                    yield event
        if replies[0].include_usage:
            yield sse_event(replies[0].usage_event(merged_usage(replies, n)))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
