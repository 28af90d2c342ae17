"""Redis worker registry: one hash per worker with a TTL that heartbeats renew.

Keys (prefix default "dsv4"): `{prefix}:worker:{worker_id}` is the `WorkerRecord` as a hash, expiring
`ttl_s` after the last publish; `{prefix}:workers` is the set of worker ids, pruned by readers when a
hash has expired. A worker that dies disappears after `ttl_s`; `withdraw` removes it at once.

Readers tolerate Redis being down: every call is bounded by `socket_timeout_s`; after a failure the
registry backs off (doubling up to `max_backoff_s`) and answers from the last view, marked stale,
logging once per outage. redis-py reconnects by itself, so it recovers without a restart.
"""

from __future__ import annotations

import logging
import threading
import time

import redis as redis_lib
from redis.backoff import NoBackoff
from redis.retry import Retry

from dsv4.discovery.base import ROLES, PoolView, WorkerRecord
from dsv4.errors import InvalidRequest, Unavailable

logger = logging.getLogger(__name__)


class RedisWorkerRegistry:
    def __init__(
        self,
        url: str,
        *,
        prefix: str = "dsv4",
        ttl_s: float = 5.0,
        refresh_interval_s: float = 0.5,
        socket_timeout_s: float = 0.5,
        max_backoff_s: float = 5.0,
    ) -> None:
        self._prefix = prefix
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._refresh_interval_s = refresh_interval_s
        self._max_backoff_s = max_backoff_s
        self._client = redis_lib.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._lock = threading.Lock()
        self._views: dict[str, PoolView] = {role: PoolView(role, ()) for role in ROLES}
        self._last_refresh_s = float("-inf")  # monotonic
        self._backoff_s = 0.0
        self._next_attempt_s = float("-inf")  # monotonic
        self._is_down = False

    # ---- worker side -------------------------------------------------------------------------

    def publish(self, record: WorkerRecord) -> None:
        key = self._worker_key(record.worker_id)
        try:
            with self._client.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping=record.to_fields())
                pipe.pexpire(key, self._ttl_ms)
                pipe.sadd(self._index_key, record.worker_id)
                pipe.execute()
        except redis_lib.RedisError as exc:
            raise Unavailable(f"redis registry: cannot publish {record.worker_id}: {exc}") from exc

    def withdraw(self, worker_id: str) -> None:
        try:
            with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(self._worker_key(worker_id))
                pipe.srem(self._index_key, worker_id)
                pipe.execute()
        except redis_lib.RedisError as exc:
            raise Unavailable(f"redis registry: cannot withdraw {worker_id}: {exc}") from exc

    # ---- router side -------------------------------------------------------------------------

    def list(self, role: str, *, include_draining: bool = False) -> PoolView:
        if role not in ROLES:
            raise InvalidRequest(f"worker role {role!r} must be one of {ROLES}")
        if time.monotonic() - self._last_refresh_s >= self._refresh_interval_s:
            self.refresh()
        with self._lock:
            view = self._views[role]
        if include_draining:
            return view
        healthy = tuple(w for w in view.workers if not w.draining)
        return PoolView(role, healthy, view.is_stale, view.fetched_at)

    def refresh(self) -> bool:
        now_s = time.monotonic()
        if now_s < self._next_attempt_s:
            return False  # backing off after a failure: serve the stale view
        try:
            records = self._read_all()
        except redis_lib.RedisError as exc:
            self._on_failure(exc)
            return False
        fetched_at = time.time()
        by_role: dict[str, list[WorkerRecord]] = {role: [] for role in ROLES}
        for record in records:
            by_role[record.role].append(record)
        with self._lock:
            self._views = {
                role: PoolView(
                    role, tuple(sorted(workers, key=lambda w: w.worker_id)), False, fetched_at
                )
                for role, workers in by_role.items()
            }
            self._last_refresh_s = time.monotonic()
        if self._is_down:
            logger.info("redis registry is reachable again; %d workers", len(records))
        self._is_down = False
        self._backoff_s = 0.0
        self._next_attempt_s = float("-inf")
        return True

    def close(self) -> None:
        self._client.close()

    # ---- internals ---------------------------------------------------------------------------

    @property
    def _index_key(self) -> str:
        return f"{self._prefix}:workers"

    def _worker_key(self, worker_id: str) -> str:
        return f"{self._prefix}:worker:{worker_id}"

    def _read_all(self) -> list[WorkerRecord]:
        worker_ids = sorted(self._client.smembers(self._index_key))
        if not worker_ids:
            return []
        with self._client.pipeline(transaction=False) as pipe:
            for worker_id in worker_ids:
                pipe.hgetall(self._worker_key(worker_id))
            hashes = pipe.execute()
        records, expired = [], []
        for worker_id, fields in zip(worker_ids, hashes):
            if not fields:
                expired.append(worker_id)
                continue
            try:
                records.append(WorkerRecord.from_fields(fields))
            except InvalidRequest as exc:
                logger.warning("redis registry: skipping %s: %s", worker_id, exc)
        if expired:
            # NOTE: a worker that re-publishes right now re-adds itself on its next heartbeat.
            self._client.srem(self._index_key, *expired)
        return records

    def _on_failure(self, exc: Exception) -> None:
        self._backoff_s = min(self._max_backoff_s, max(0.1, 2 * self._backoff_s))
        self._next_attempt_s = time.monotonic() + self._backoff_s
        if not self._is_down:
            logger.warning(
                "redis registry unreachable (%s); serving the last known view, marked stale", exc
            )
        self._is_down = True
        with self._lock:
            self._views = {
                role: PoolView(role, view.workers, True, view.fetched_at)
                for role, view in self._views.items()
            }
