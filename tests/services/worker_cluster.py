"""Helpers for tests against real worker processes: a cached tiny checkpoint, the single-engine
baseline built exactly like the workers, gRPC stubs with the shared secret, and leak checks
over Info (every block free, no leases)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from dsv4 import wire
from dsv4.cache.layout import KVLayout
from dsv4.commands.cluster import ClusterSpec, LocalCluster
from dsv4.commands.service_args import service_config
from dsv4.commands.tiny_checkpoint import ensure_tiny_checkpoint
from dsv4.rpc.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from dsv4.types import (
    DecodeRequest,
    GenerateRequest,
    PromptLogprobs,
    PullFailurePolicy,
    SamplingParams,
    TokenLogprobs,
)
from dsv4.worker.server import TOKEN_METADATA_KEY

LAYERS = "0,4"  # two layers (a C4 layer included): fast on 2 cores
SECRET = "test-secret"
METADATA = ((TOKEN_METADATA_KEY, SECRET),)
NUM_BLOCKS = 48
LEASE_TTL_S = 3.0
# Flags for every worker of the tests' clusters (see `service_args`).
WORKER_ARGS = (
    "--num-blocks", str(NUM_BLOCKS), "--block-size", "128", "--lease-ttl-s", str(LEASE_TTL_S),
    "--pull-timeout-s", "2", "--shared-secret", SECRET, "--max-num-seqs", "64",
    "--max-num-batched-tokens", "2048", "--log-level", "warning", "--heartbeat-s", "0.5",
    "--drain-timeout-s", "2",
)  # fmt: skip
PROMPTS = [
    [5, 9, 200, 17, 33, 41, 7, 300, 12, 99, 4, 8],
    list(range(2, 150)),
    [700, 3, 3, 3, 81, 1000, 64],
]


# one request of the single-engine baseline: its tokens, their logprobs, its prompt's
EngineRun = tuple[list[int], list[TokenLogprobs], PromptLogprobs | None]


def tiny_checkpoint(cache_dir: Path) -> Path:
    return ensure_tiny_checkpoint(cache_dir, LAYERS)


def start_cluster(model_dir: Path, **spec: object) -> LocalCluster:
    spec.setdefault("service_args", WORKER_ARGS)
    cluster = LocalCluster(ClusterSpec(model_dir=str(model_dir), grace_s=5.0, **spec))  # type: ignore[arg-type]
    cluster.start(ready_timeout_s=120.0)
    return cluster


def worker_kv(model_dir: Path, service_args: Sequence[str]) -> tuple[KVLayout, int]:
    """(KV layout, number of blocks) of a worker started with `service_args` (argparse: a
    repeated flag's last value wins), from a runtime built the way the worker builds its own."""
    from dsv4.worker.build import build_worker_runtime

    config = service_config(("--model", str(model_dir), *service_args), {})
    runtime = build_worker_runtime(config, with_transport=False, name="layout")
    return runtime.layout, runtime.engine.core.kv.num_blocks


def num_blocks_at_once(
    layout: KVLayout, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> int:
    """KV blocks `prompts` hold when they all run at once at full length: per request the
    scheduler's own bound (`check_fits`), ring blocks + token blocks for prompt +
    max_new_tokens + draft slots. A pool this big never refuses nor preempts them."""
    num_draft = layout.options.num_speculative_tokens
    return sum(layout.num_blocks_for_request(len(p) + max_new_tokens + num_draft) for p in prompts)


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)


def single_engine_outputs(
    model_dir: Path,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    overrides: dict[str, object] | None = None,
    sampling: dict[str, float] | None = None,
) -> list[list[int]]:
    """The baseline: one engine built by `build_worker_runtime` with the workers' config
    (plus `overrides`, e.g. the workers' `features.forward`); greedy, with `sampling`'s
    fields (e.g. penalties) on every request."""
    runs = single_engine_runs(model_dir, prompts, max_new_tokens, overrides, sampling)
    return [tokens for tokens, *_ in runs]


def single_engine_runs(
    model_dir: Path,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    overrides: dict[str, object] | None = None,
    sampling: dict[str, float] | None = None,
) -> list[EngineRun]:
    """`single_engine_outputs` with each request's logprobs (empty unless `sampling` asks)
    and its prompt's (None unless `sampling` asks prompt_logprobs)."""
    from dsv4.config import load_config
    from dsv4.worker.build import build_worker_runtime

    config = load_config({"model.path": str(model_dir), "cache.num_blocks": NUM_BLOCKS,
                          "cache.block_size": 128, **(overrides or {})})  # fmt: skip
    runtime = build_worker_runtime(config, with_transport=False, name="baseline")

    async def run_all() -> list[EngineRun]:
        runtime.engine.start()
        try:

            async def one(i: int, prompt: Sequence[int]) -> EngineRun:
                params = dataclasses.replace(greedy(max_new_tokens), **(sampling or {}))
                request = GenerateRequest(f"base-{i}", tuple(prompt), params)
                tokens: list[int] = []
                logprobs: list[TokenLogprobs] = []
                prompt_logprobs = None
                async for out in runtime.engine.generate(runtime.engine_request(request)):
                    tokens.extend(out.new_token_ids)
                    logprobs.extend(out.logprobs)
                    prompt_logprobs = prompt_logprobs or out.prompt_logprobs
                return tokens, logprobs, prompt_logprobs

            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
        finally:
            await runtime.engine.stop()

    return asyncio.run(run_all())


class Workers:
    """Stubs for one prefill and one decode worker (async; make one per event loop)."""

    def __init__(self, prefill_address: str, decode_address: str) -> None:
        self.prefill_channel = grpc.aio.insecure_channel(prefill_address)
        self.decode_channel = grpc.aio.insecure_channel(decode_address)
        self.prefill = worker_pb2_grpc.PrefillWorkerStub(self.prefill_channel)
        self.decode = worker_pb2_grpc.DecodeWorkerStub(self.decode_channel)

    async def close(self) -> None:
        await self.prefill_channel.close()
        await self.decode_channel.close()

    async def prefill_request(self, request: GenerateRequest):
        msg = wire.prefill_request_to_proto(request)
        return wire.prefill_result_from_proto(await self.prefill.Prefill(msg, metadata=METADATA))

    def decode_stream(
        self, request: GenerateRequest, prefill=None, policy=PullFailurePolicy.RECOMPUTE
    ):
        decode = DecodeRequest(
            request=request,
            first_token_id=prefill.first_token_id if prefill else None,
            handle=prefill.handle if prefill else None,
            pull_failure_policy=policy,
        )
        return self.decode.Decode(wire.decode_request_to_proto(decode), metadata=METADATA)

    async def generate(self, request: GenerateRequest, policy=PullFailurePolicy.RECOMPUTE):
        """Prefill on P, decode on D: (all tokens, the decode chunks)."""
        prefill = await self.prefill_request(request)
        chunks = [
            wire.decode_response_from_proto(m)
            async for m in self.decode_stream(request, prefill, policy)
        ]
        tokens = [prefill.first_token_id] + [t for c in chunks for t in c.token_ids]
        return tokens, chunks

    async def info(self, which: str):
        stub = self.prefill if which == "prefill" else self.decode
        return wire.worker_info_from_proto(
            await stub.Info(worker_pb2.InfoRequest(), metadata=METADATA)
        )

    async def abort_decode(self, request_id: str) -> bool:
        msg = common_pb2.AbortRequest(request_id=request_id)
        return (await self.decode.Abort(msg, metadata=METADATA)).was_found

    async def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Leak check over gRPC: both workers show every block free and no leases/requests."""
        give_up_s = time.monotonic() + timeout_s
        while True:
            infos = [await self.info("prefill"), await self.info("decode")]
            leaks = [
                f"{i.worker_id}: {i.num_free_blocks}/{i.num_total_blocks} free, "
                f"{i.num_leases} leases, {i.num_running_requests} running"
                for i in infos
                if i.num_free_blocks != i.num_total_blocks or i.num_leases or i.num_running_requests
            ]
            if not leaks:
                return
            if time.monotonic() > give_up_s:
                raise AssertionError("leaks found over Info:\n  " + "\n  ".join(leaks))
            await asyncio.sleep(0.1)
