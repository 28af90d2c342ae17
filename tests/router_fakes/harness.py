"""A RouterServer in front of scripted workers, for tests and demos of the router's control flow.

`scripted_cluster(prefills, decodes, **config)` starts the workers, a router on a free loopback
port (static discovery, fast probes, the tiny tokenizer) and a client channel; on exit it stops
everything and asserts the router leaked nothing (live requests, cleanup tasks, admission slots).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from dsv4.config import load_config
from dsv4.discovery.base import WorkerRegistry
from dsv4.discovery.static import StaticWorkerRegistry
from dsv4.rpc.v1 import common_pb2, router_pb2, router_pb2_grpc
from dsv4.text.tokenizer import build_tokenizer
from router_svc.pool import PoolSettings
from router_svc.server import RouterServer
from router_svc.text_model import TextModel, text_model
from tests.router_fakes.scripted_workers import ScriptedDecodeWorker, ScriptedPrefillWorker

ROUTABLE_WAIT_S = 5.0
FAST_PROBES = PoolSettings(probe_interval_s=0.05, probe_timeout_s=0.2, num_failures_to_down=2)
_TEXT_MODELS: dict[int, TextModel] = {}


def tiny_text_model(vocab_size: int = 1000) -> TextModel:
    """The deterministic tiny tokenizer (built once per vocabulary size)."""
    if vocab_size not in _TEXT_MODELS:
        _TEXT_MODELS[vocab_size] = text_model(build_tokenizer(vocab_size), source="tiny")
    return _TEXT_MODELS[vocab_size]


@dataclass
class ScriptedCluster:
    server: RouterServer
    stub: router_pb2_grpc.RouterStub
    channel: grpc.aio.Channel
    prefills: list[ScriptedPrefillWorker]
    decodes: list[ScriptedDecodeWorker]


@asynccontextmanager
async def scripted_cluster(
    prefills: Sequence[ScriptedPrefillWorker] = (),
    decodes: Sequence[ScriptedDecodeWorker] = (),
    *,
    pool_settings: PoolSettings = FAST_PROBES,
    metadata: tuple[tuple[str, str], ...] = (),
    registry: WorkerRegistry | None = None,
    text: TextModel | None = None,
    **config: Any,
) -> AsyncIterator[ScriptedCluster]:
    """`config`: ServeConfig overrides with "__" for "." (router__max_inflight_requests=2).
    `registry`: discovery (default: static lists of the workers); workers started by the
    caller (to publish their addresses first) are not started again. `text`: the
    router's tokenizer (default: the tiny one; `TextModel(None)`: a router without one)."""
    for worker in (*prefills, *decodes):
        if not worker.is_serving:
            await worker.start()
    overrides = {"router.port": 0, "router.prefill_timeout_s": 5.0}
    overrides |= {key.replace("__", "."): value for key, value in config.items()}
    if registry is None:
        registry = StaticWorkerRegistry([p.address for p in prefills], [d.address for d in decodes])
    server = RouterServer(
        load_config(overrides),
        registry=registry,
        pool_settings=pool_settings,
        text_model=text if text is not None else tiny_text_model(),
    )
    try:
        await server.start()
        if prefills or decodes:  # start() probes once; on a loaded box that probe can time out
            await _until_routable(server, ROUTABLE_WAIT_S)
        channel = grpc.aio.insecure_channel(server.address)
        try:
            yield ScriptedCluster(
                server, router_pb2_grpc.RouterStub(channel), channel, [*prefills], [*decodes]
            )
        finally:
            await channel.close()
    finally:
        await server.stop(0.5)
        for worker in (*prefills, *decodes):
            await worker.stop()
    leaks = server.find_leaks()
    assert not leaks, leaks


async def _until_routable(server: RouterServer, timeout_s: float) -> None:
    """Wait (bounded) until the pool can route a request: the scripted workers all answer
    probes from the start, so this only absorbs a slow first probe round. Tests that make
    workers unhealthy do so after the cluster is up."""
    deadline_s = time.monotonic() + timeout_s
    while not server.pool.snapshot().has_route and time.monotonic() < deadline_s:
        await asyncio.sleep(0.02)


def generate_request(
    max_new_tokens: int,
    prompt: Sequence[int] | str,
    *,
    request_id: str = "",
    **sampling: Any,
) -> router_pb2.GenerateRequest:
    """A Router.GenerateRequest with token ids or text; `sampling`: SamplingParams fields."""
    msg = router_pb2.GenerateRequest(
        request_id=request_id,
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens, **sampling),
    )
    if isinstance(prompt, str):
        msg.prompt = prompt
    else:
        msg.prompt_token_ids.ids.extend(prompt)
    return msg


async def read_outcome(call: Any) -> tuple[grpc.StatusCode, str, list[Any]]:
    """(status, details, messages) of a Generate call, read to its end with `read()`."""
    messages = []
    try:
        while (msg := await call.read()) is not grpc.aio.EOF:
            messages.append(msg)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or "", messages
    return grpc.StatusCode.OK, "", messages
