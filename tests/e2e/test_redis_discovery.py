"""Redis discovery end to end: workers heartbeat into a real redis-server, the router finds them
there and ignores records forged into it (nothing dials the address they name); Redis stopped (the router serves from its last view) and restarted (workers re-publish,
the registry recovers) without restarting any service."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import grpc
import pytest
import redis as redis_lib
from e2e_cluster import assert_no_worker_leaks, generate, greedy

from dsv4.commands.cluster import free_port
from dsv4.discovery import WorkerRecord, make_registry
from dsv4.transfer import TransportEndpoint
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
        workers = [w for role in ("prefill", "decode") for w in registry.list(role).workers]
    finally:
        registry.close()
    for worker in workers:  # Redis readers learn no NIXL metadata (no key to any KV block)
        assert TransportEndpoint.from_bytes(worker.transport_endpoint).payload == b""
    return {w.worker_id for w in workers}


class Trap:
    def __init__(self, address: str) -> None:
        self.address, self.count = address, 0


@contextlib.contextmanager
def trap_listener():
    """A TCP port that counts the connections it gets (a server an attacker would run)."""
    sock = socket.create_server(("127.0.0.1", 0))
    sock.settimeout(0.1)
    trap = Trap(f"127.0.0.1:{sock.getsockname()[1]}")
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                sock.accept()[0].close()
                trap.count += 1

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield trap
    finally:
        stop.set()
        thread.join(timeout=5)
        sock.close()


def forge_records(url: str, address: str) -> None:
    """What an attacker with Redis access writes: an unsigned record, and a worker's signed
    record moved to a new id with its address changed."""
    client = redis_lib.Redis.from_url(url, decode_responses=True)
    forged = WorkerRecord("prefill", "prefill-evil", address, updated_at=time.time())
    altered = {**client.hgetall("dsv4:worker:prefill-0"), "worker_id": "prefill-evil2"}
    altered["address"] = address
    for worker_id, fields in (("prefill-evil", forged.to_fields()), ("prefill-evil2", altered)):
        client.hset(f"dsv4:worker:{worker_id}", mapping=fields)
        client.sadd("dsv4:workers", worker_id)
    client.close()


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
        with trap_listener() as connections:  # a forged record must not route anything there
            forge_records(redis.url, connections.address)
            time.sleep(2.0)  # several router refreshes and probe rounds
            asyncio.run(one_request())
            assert connections.count == 0, "the router dialled a forged worker"
        assert "ignoring the record of 'prefill-evil'" in cluster.service("router").log_tail(200)
        assert listed_worker_ids(redis.url) == {"prefill-0", "decode-0"}
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
