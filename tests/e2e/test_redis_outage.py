"""Redis down for a long time under traffic (default 30 s; `DSV4TEST_REDIS_OUTAGE_S` shortens it):
first hung (SIGSTOP, every registry call times out), then gone (stopped, connections refused).
No request hangs: every one finishes OK within a bound while the router routes from its last
view; after Redis returns (empty) requests keep succeeding (the router keeps workers missing
from a freshly recovered registry for `discovery.ttl_s`), the workers re-register by themselves,
nothing restarts, and no block leaks."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest
from e2e_cluster import assert_no_worker_leaks, generate, greedy

from dsv4.commands.cluster import free_port
from tests.e2e.test_redis_discovery import listed_worker_ids, wait_for
from tests.redis_server import RedisServer
from tests.services.worker_cluster import PROMPTS, start_cluster, tiny_checkpoint

OUTAGE_S = float(os.environ.get("DSV4TEST_REDIS_OUTAGE_S", "30"))
HUNG_S = min(5.0, OUTAGE_S)
MAX_REQUEST_S = 5.0  # one short request, Redis or not
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120 + 2 * OUTAGE_S)]


@pytest.fixture
def redis():
    try:
        server = RedisServer()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    server.start()
    yield server
    server.close()


async def traffic_for(address: str, seconds: float) -> list[float]:
    """One request every ~0.5 s for `seconds`; each must succeed. Returns their durations."""
    durations = []
    give_up_s = time.monotonic() + seconds
    async with grpc.aio.insecure_channel(address) as channel:
        while time.monotonic() < give_up_s:
            started_s = time.monotonic()
            outcome = await generate(channel, PROMPTS[0], greedy(4), timeout_s=MAX_REQUEST_S)
            assert outcome.code is grpc.StatusCode.OK, outcome
            durations.append(time.monotonic() - started_s)
            await asyncio.sleep(0.5)
    return durations


def test_traffic_continues_through_a_redis_outage_and_recovers_without_restarts(
    redis, tmp_path_factory
) -> None:
    model_dir = tiny_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache")
    cluster = start_cluster(model_dir, redis_url=redis.url, router_port=free_port())
    try:
        pids = {s.name: s.process.pid for s in cluster.services}
        asyncio.run(traffic_for(cluster.router_address, 1.0))
        redis.pause()
        try:
            hung = asyncio.run(traffic_for(cluster.router_address, HUNG_S))
        finally:
            redis.resume()
        redis.stop()
        gone = asyncio.run(traffic_for(cluster.router_address, OUTAGE_S - HUNG_S))
        redis.start()  # same port, empty until each worker's next heartbeat
        started_s = time.monotonic()
        after = asyncio.run(traffic_for(cluster.router_address, 3.0))  # no gap meanwhile
        wait_for(lambda: listed_worker_ids(redis.url) == {"prefill-0", "decode-0"}, 10.0)
        reregistered_s = time.monotonic() - started_s
        assert not cluster.dead_services()
        assert {s.name: s.process.pid for s in cluster.services} == pids
        asyncio.run(assert_no_worker_leaks(cluster))
    finally:
        cluster.stop()
    print(
        f"Redis outage {OUTAGE_S:.0f} s: {len(hung)} requests while hung (max "
        f"{max(hung):.2f} s), {len(gone)} while stopped (max {max(gone, default=0):.2f} s); "
        f"workers listed again within {reregistered_s:.2f} s of Redis' return; "
        f"{len(after)} requests after (max {max(after):.2f} s)"
    )
