"""Redis discovery end to end: workers heartbeat into a real redis-server, the router finds them
there; Redis stopped (the router serves from its last view) and restarted (workers re-publish,
the registry recovers) without restarting any service."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from e2e_cluster import assert_no_worker_leaks, generate, greedy

from dsv4.cluster import free_port
from dsv4.discovery import make_registry
from tests.redis_server import RedisServer
from tests.services.worker_cluster import PROMPTS, SECRET, start_cluster, tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def redis():
    try:
        server = RedisServer()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    server.start()
    yield server
    server.close()


def listed_worker_ids(url: str) -> set[str]:
    registry = make_registry(redis_url=url, secret=SECRET)
    try:
        registry.refresh()
        return {w.worker_id for role in ("prefill", "decode") for w in registry.list(role).workers}
    finally:
        registry.close()


def wait_for(predicate, timeout_s: float) -> None:
    give_up_s = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < give_up_s, "timed out"
        time.sleep(0.1)


def test_registry_survives_a_redis_restart(redis, tmp_path_factory) -> None:
    model_dir = tiny_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache")
    cluster = start_cluster(model_dir, redis_url=redis.url, router_port=free_port())
    try:
        assert listed_worker_ids(redis.url) == {"prefill-0", "decode-0"}

        async def one_request(must_succeed: bool = True) -> grpc.StatusCode:
            async with grpc.aio.insecure_channel(cluster.router_address) as channel:
                outcome = await generate(channel, PROMPTS[0], greedy(4), timeout_s=30)
            if must_succeed or outcome.code is grpc.StatusCode.OK:
                assert outcome.code is grpc.StatusCode.OK, outcome
                assert len(outcome.token_ids) == 4
            return outcome.code

        asyncio.run(one_request())
        redis.stop()
        time.sleep(1.5)  # several heartbeats and router refreshes fail meanwhile
        asyncio.run(one_request())  # the router routes from its last known view
        redis.start()  # same port, empty: the workers must re-publish by themselves
        wait_for(lambda: listed_worker_ids(redis.url) == {"prefill-0", "decode-0"}, 10.0)
        # The router may have seen the empty Redis: it lists and probes the workers again and
        # routes within a few heartbeats (UNAVAILABLE meanwhile, never a hang).
        give_up_s = time.monotonic() + 10.0
        while (code := asyncio.run(one_request(must_succeed=False))) is not grpc.StatusCode.OK:
            assert code is grpc.StatusCode.UNAVAILABLE and time.monotonic() < give_up_s, code
            time.sleep(0.2)
        assert not cluster.dead_services()
        asyncio.run(assert_no_worker_leaks(cluster))
    finally:
        cluster.stop()
