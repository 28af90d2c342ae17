"""Helpers for end-to-end tests: a real local cluster (router + workers, real NIXL), a router
client, extra router processes, and the leak check over every worker's Info."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import pytest

from dsv4 import wire
from dsv4.commands.cluster import LocalCluster, free_port, is_serving, terminate
from dsv4.rpc.v1 import router_pb2_grpc, worker_pb2, worker_pb2_grpc
from dsv4.types import SamplingParams, StreamChunk, TokenLogprobs
from tests.services.worker_cluster import WORKER_ARGS


@dataclass
class Outcome:
    """What one Generate stream produced: chunks, or the status that ended it."""

    chunks: list[StreamChunk] = field(default_factory=list)
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def ending(self) -> str:
        """How the stream ended, for assertions that should say why: `OK/LENGTH`,
        `UNAVAILABLE: <details>`, `OK/no last chunk`."""
        if self.code is not grpc.StatusCode.OK:
            return f"{self.code.name}: {self.details}"
        last = self.chunks[-1].finish_reason if self.chunks else None
        return f"OK/{last.name}" if last is not None else "OK/no last chunk"


def log_tails(cluster: LocalCluster, num_lines: int = 40) -> str:
    """Every service's log tail, to attach to a failed end-to-end assertion."""
    return "\n".join(f"--- {s.name}\n{s.log_tail(num_lines)}" for s in cluster.services)


def greedy(max_new_tokens: int, **more: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True, **more)  # type: ignore[arg-type]


async def generate(
    channel: grpc.aio.Channel,
    prompt: str | Sequence[int],
    sampling: SamplingParams | None,
    *,
    request_id: str = "",
    timeout_s: float = 60.0,
) -> Outcome:
    stub = router_pb2_grpc.RouterStub(channel)
    msg = wire.generate_request_to_proto(prompt, sampling, request_id=request_id)
    outcome = Outcome()
    try:
        async for reply in stub.Generate(msg, timeout=timeout_s):
            outcome.chunks.append(wire.generate_response_from_proto(reply))
    except grpc.aio.AioRpcError as exc:
        outcome.code, outcome.details = exc.code(), exc.details() or ""
    return outcome


def routed_logprobs(router_address: str, prompt: list[int], max_tokens: int):
    """(tokens, their logprobs, text, the prompt's logprobs) of a greedy gRPC Generate asking
    3 of each; only the first chunk may carry the prompt's."""

    async def run():
        sampling = greedy(max_tokens, logprobs=3, prompt_logprobs=3)
        async with grpc.aio.insecure_channel(router_address) as channel:
            outcome = await generate(channel, prompt, sampling)
        assert outcome.code is grpc.StatusCode.OK, outcome.details
        assert all(c.prompt_logprobs is None for c in outcome.chunks[1:])
        entries = [lp for c in outcome.chunks for lp in c.logprobs]
        return outcome.token_ids, entries, outcome.text, outcome.chunks[0].prompt_logprobs

    return asyncio.run(run())


def assert_logprobs_close(got: Sequence[TokenLogprobs], want: Sequence[TokenLogprobs]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and a.rank == b.rank
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)


async def worker_leaks(cluster: LocalCluster) -> list[str]:
    """Blocks not free, leases or requests still held, on every live worker (Info)."""
    leaks = []
    for service in cluster.services:
        if service.role == "router" or service.process.poll() is not None:
            continue
        credentials = cluster.credentials  # TLS clusters: the CA and, for mTLS, a client cert
        if credentials is not None:
            channel = grpc.aio.secure_channel(service.address, credentials)  # type: ignore[arg-type]
        else:
            channel = grpc.aio.insecure_channel(service.address)
        async with channel:
            stub_class = (
                worker_pb2_grpc.PrefillWorkerStub
                if service.role == "prefill"
                else worker_pb2_grpc.DecodeWorkerStub
            )
            msg = await stub_class(channel).Info(
                worker_pb2.InfoRequest(), metadata=cluster.worker_metadata, timeout=5
            )
        info = wire.worker_info_from_proto(msg)
        if (
            info.num_free_blocks != info.num_total_blocks
            or info.num_leases
            or info.num_running_requests
        ):
            leaks.append(
                f"{service.name}: {info.num_free_blocks}/{info.num_total_blocks} free, "
                f"{info.num_leases} leases, {info.num_running_requests} running"
            )
    return leaks


async def assert_no_worker_leaks(cluster: LocalCluster, timeout_s: float = 10.0) -> None:
    give_up_s = time.monotonic() + timeout_s
    while leaks := await worker_leaks(cluster):
        if time.monotonic() > give_up_s:
            raise AssertionError("leaks found over Info:\n  " + "\n  ".join(leaks))
        await asyncio.sleep(0.1)


class ExtraRouter:
    """Another router process (own flags) in front of the cluster's workers, or of nothing."""

    def __init__(self, model_dir: str, prefill: Sequence[str], decode: Sequence[str], *args: str):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        command = [
            sys.executable, "-m", "dsv4.commands.cli", "router", "--model", model_dir,
            "--port", str(self.port), *WORKER_ARGS, *args,
        ]  # fmt: skip
        if prefill:
            command += ["--prefill", ",".join(prefill)]
        if decode:
            command += ["--decode", ",".join(decode)]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )

    def wait_ready(self, health_name: str = "dsv4.v1.Router", timeout_s: float = 60.0) -> None:
        give_up_s = time.monotonic() + timeout_s
        while not is_serving(self.address, health_name):
            assert self.process.poll() is None, "the extra router exited"
            assert time.monotonic() < give_up_s, "the extra router never became ready"
            time.sleep(0.2)

    def stop(self) -> None:
        terminate(self.process, signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            terminate(self.process, signal.SIGKILL)
            self.process.wait(timeout=10)


def kill(cluster: LocalCluster, name: str) -> None:
    """SIGKILL one service (no drain, no goodbye: a crash)."""
    service = cluster.service(name)
    os.kill(service.process.pid, signal.SIGKILL)
    service.process.wait(timeout=10)
