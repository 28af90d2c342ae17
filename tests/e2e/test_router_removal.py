"""Defect 3 of issue 20 on real processes: Redis discovery with a 1 s TTL, a decode worker
stopped (SIGSTOP) mid-stream. Its record expires before the router's third failed probe; the
stream must still end with UNAVAILABLE naming the worker, within about a probe interval of
the removal (it used to end with no status at all, 30 s later), and after SIGCONT the worker
re-publishes and the cluster serves again, with no leaked block or lease."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
from e2e_cluster import assert_no_worker_leaks, generate, greedy

from dsv4 import wire
from dsv4.commands.cluster import free_port
from dsv4.rpc.v1 import router_pb2_grpc
from tests.redis_server import RedisServer, redis_server  # noqa: F401  (fixture)
from tests.services.worker_cluster import PROMPTS, WORKER_ARGS, start_cluster, tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
TTL_S = 1.0  # the smallest the config allows with --heartbeat-s 0.5


async def stream_until_stopped(address: str, decode_pid: int) -> tuple[grpc.StatusCode, str, float]:
    """Stream a long request, SIGSTOP D after a few tokens; (code, details, s after SIGSTOP)."""
    async with grpc.aio.insecure_channel(address) as channel:
        msg = wire.generate_request_to_proto(PROMPTS[0], greedy(400))
        num_tokens, stopped_at_s = 0, 0.0
        try:
            async for reply in router_pb2_grpc.RouterStub(channel).Generate(msg, timeout=60):
                num_tokens += len(reply.token_ids)
                if num_tokens >= 5 and not stopped_at_s:
                    os.kill(decode_pid, signal.SIGSTOP)
                    stopped_at_s = time.monotonic()
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or "", time.monotonic() - stopped_at_s
    return grpc.StatusCode.OK, f"finished with {num_tokens} tokens", 0.0


def test_stopped_decode_whose_record_expires_ends_its_stream_with_a_status(
    redis_server: RedisServer,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model_dir = tiny_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache")
    args = (*WORKER_ARGS, "--discovery-ttl-s", str(TTL_S))
    cluster = start_cluster(
        model_dir, redis_url=redis_server.url, router_port=free_port(), service_args=args
    )
    decode_pid = cluster.service("decode-0").process.pid
    try:
        code, details, after_s = asyncio.run(
            stream_until_stopped(cluster.router_address, decode_pid)
        )
        assert code is grpc.StatusCode.UNAVAILABLE, details
        address = cluster.service("decode-0").address
        assert address in details and ("left discovery" in details or "probes" in details)
        # TTL 1 s + a registry refresh + a probe round (0.5 s each); generous for a 2-core box
        assert after_s < 4.0, (after_s, details)
        os.kill(decode_pid, signal.SIGCONT)
        give_up_s = time.monotonic() + 20.0
        while True:  # D re-publishes within a heartbeat and is probed again
            outcome = asyncio.run(_one_request(cluster.router_address))
            if outcome.code is grpc.StatusCode.OK:
                break
            assert time.monotonic() < give_up_s, outcome
            time.sleep(0.2)
        assert len(outcome.token_ids) == 4
        asyncio.run(assert_no_worker_leaks(cluster, timeout_s=15.0))
        assert not cluster.dead_services()
    finally:
        os.kill(decode_pid, signal.SIGCONT)
        cluster.stop()


async def _one_request(address: str):
    async with grpc.aio.insecure_channel(address) as channel:
        return await generate(channel, PROMPTS[0], greedy(4), timeout_s=10)
