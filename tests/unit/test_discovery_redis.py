"""Redis registry against a real redis-server started by the test (tests/redis_server.py)."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest
import redis
from redis_server import RedisServer, redis_server  # noqa: F401  (fixture)

from dsv4.discovery import PoolView, WorkerHeartbeat, WorkerRecord
from dsv4.discovery.redis import SIGNATURE_FIELD, RecordSigner, RedisWorkerRegistry
from dsv4.errors import ConfigError

pytestmark = pytest.mark.timeout(60)
SECRET = "registry-test-secret"


def _record(role: str, index: int, **changes) -> WorkerRecord:
    record = WorkerRecord(
        role=role,
        worker_id=f"{role}-{index}",
        address=f"127.0.0.1:{50060 + index}",
        transport_kind="nixl",
        transport_endpoint=bytes(range(256)) * 2,
        layout_hash="abc123",
        free_blocks=100 + index,
        queued_prefill_tokens=7 * index,
        running_requests=index,
    )
    return dataclasses.replace(record, **changes)


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _registry(server: RedisServer, **options) -> RedisWorkerRegistry:
    options = {"ttl_s": 1.0, "refresh_interval_s": 0.0, "max_backoff_s": 0.5, **options}
    return RedisWorkerRegistry(server.url, secret=SECRET, prefix="test", **options)


def test_publish_then_list_by_role(redis_server: RedisServer) -> None:  # noqa: F811
    registry = _registry(redis_server, ttl_s=30.0)
    published = [_record("prefill", 0), _record("prefill", 1), _record("decode", 2)]
    for record in published:
        registry.publish(record)
    prefill = registry.list("prefill")
    assert isinstance(prefill, PoolView) and not prefill.is_stale
    assert prefill.workers == tuple(published[:2])
    assert registry.list("decode").workers == (published[2],)
    registry.withdraw("prefill-0")
    assert [w.worker_id for w in registry.list("prefill").workers] == ["prefill-1"]
    registry.close()


def test_draining_worker_is_not_listed(redis_server: RedisServer) -> None:  # noqa: F811
    registry = _registry(redis_server, ttl_s=30.0)
    registry.publish(_record("decode", 0))
    registry.publish(_record("decode", 1, draining=True))
    assert [w.worker_id for w in registry.list("decode").workers] == ["decode-0"]
    everyone = registry.list("decode", include_draining=True).workers
    assert [(w.worker_id, w.draining) for w in everyone] == [
        ("decode-0", False),
        ("decode-1", True),
    ]
    registry.close()


def test_dead_worker_expires_after_ttl(redis_server: RedisServer) -> None:  # noqa: F811
    registry = _registry(redis_server, ttl_s=0.5)
    alive = WorkerHeartbeat(registry, lambda: _record("prefill", 0), interval_s=0.1)
    alive.start()
    registry.publish(_record("prefill", 1))  # no heartbeat: dies after the TTL
    try:
        assert _wait_for(lambda: len(registry.list("prefill").workers) == 2)
        time.sleep(1.0)  # two TTLs
        assert [w.worker_id for w in registry.list("prefill").workers] == ["prefill-0"]
    finally:
        alive.stop()
    assert _wait_for(lambda: registry.list("prefill").workers == ())
    assert alive.num_published >= 5
    registry.close()


def test_registry_survives_a_redis_restart(redis_server: RedisServer) -> None:  # noqa: F811
    registry = _registry(redis_server, ttl_s=2.0)
    heartbeat = WorkerHeartbeat(registry, lambda: _record("decode", 0), interval_s=0.1)
    heartbeat.start()
    try:
        assert _wait_for(lambda: len(registry.list("decode").workers) == 1)
        redis_server.stop()
        started = time.monotonic()
        view = registry.list("decode")
        assert time.monotonic() - started < 2.0, "a read while Redis is down must be bounded"
        assert view.is_stale and [w.worker_id for w in view.workers] == ["decode-0"]
        time.sleep(0.5)  # the heartbeat keeps failing quietly
        assert registry.list("decode").is_stale
        redis_server.start()  # same port, empty (no persistence): the heartbeat re-publishes
        assert _wait_for(lambda: not registry.list("decode").is_stale, timeout_s=10.0)
        assert _wait_for(lambda: len(registry.list("decode").workers) == 1)
    finally:
        heartbeat.stop(withdraw=True, worker_id="decode-0")
    assert registry.list("decode").workers == ()
    registry.close()


def test_record_round_trips_through_fields() -> None:
    record = _record("prefill", 3, draining=True, updated_at=1234.5)
    assert WorkerRecord.from_fields(record.to_fields()) == record


def test_forged_unsigned_and_moved_records_are_ignored_and_logged(
    redis_server: RedisServer,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = _registry(redis_server, ttl_s=30.0)
    honest = _record("prefill", 0)
    registry.publish(honest)
    raw = redis.Redis.from_url(redis_server.url, decode_responses=True)
    evil = _record("prefill", 1, address="203.0.113.9:50061")
    forged = {**evil.to_fields(), SIGNATURE_FIELD: "v1:" + "0" * 64}
    other_secret = RecordSigner("another-secret", "test").sign(evil.to_fields())
    signed_by_other = {**evil.to_fields(), "worker_id": "prefill-2", SIGNATURE_FIELD: other_secret}
    moved = raw.hgetall("test:worker:prefill-0")  # validly signed, stored under another key
    entries = {"prefill-1": forged, "prefill-2": signed_by_other, "prefill-3": moved,
               "prefill-4": evil.to_fields()}  # fmt: skip
    for worker_id, fields in entries.items():
        raw.hset(f"test:worker:{worker_id}", mapping=fields)
        raw.sadd("test:workers", worker_id)
    with caplog.at_level(logging.WARNING, logger="dsv4.discovery.redis"):
        for _ in range(3):  # each refresh ignores them; each is logged once
            assert registry.list("prefill").workers == (honest,)
    ignored = [r.getMessage() for r in caplog.records if "ignoring the record" in r.getMessage()]
    assert len(ignored) == 4, ignored
    assert any("unsigned" in m for m in ignored) and any("signed for worker" in m for m in ignored)
    tampered = {**raw.hgetall("test:worker:prefill-0"), "free_blocks": "999999"}
    raw.hset("test:worker:prefill-0", mapping=tampered)
    assert registry.list("prefill").workers == ()
    registry.publish(honest)  # the next heartbeat repairs it
    assert registry.list("prefill").workers == (honest,)
    raw.close()
    registry.close()


def test_a_redis_registry_needs_the_secret(redis_server: RedisServer) -> None:  # noqa: F811
    with pytest.raises(ConfigError, match="shared_secret"):
        RedisWorkerRegistry(redis_server.url, secret="")
