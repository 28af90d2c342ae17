"""Redis worker registry: one signed hash per worker with a TTL that heartbeats renew.

Keys (prefix default "dsv4"): `{prefix}:worker:{worker_id}` is the `WorkerRecord` as a hash, expiring
`ttl_s` after the last publish; `{prefix}:workers` is the set of worker ids, pruned by readers when a
hash has expired. A worker that dies disappears after `ttl_s`; `withdraw` removes it at once.

Every record carries `sig`, an HMAC-SHA256 over the prefix and all its fields under a key derived
from `security.shared_secret`. Readers ignore (and log once) a record that is unsigned, forged,
altered or stored under another worker's key, so whoever can write to Redis cannot point the
router at a server of their choosing (which would receive the secret and the prompts). A signed
record can still be replayed or deleted by them: Redis access is a denial-of-service risk.

Readers tolerate Redis being down: every call is bounded by `socket_timeout_s`; a dropped
connection is retried by redis-py itself (`Retry(ExponentialBackoff(), RETRIES)`, connection
errors only: a hung Redis is not waited on twice); after a failure the registry stops asking for
a while (doubling up to `max_backoff_s`) and answers from the last view, marked stale, logging
once per outage. redis-py reconnects by itself, so it recovers without a restart.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time

import redis as redis_lib
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from dsv4.discovery.base import ROLES, PoolView, WorkerRecord
from dsv4.errors import ConfigError, InvalidRequest, Unavailable

logger = logging.getLogger(__name__)

SIGNATURE_FIELD = "sig"
SIGNATURE_VERSION = "v1"
RETRIES = 2  # redis-py's own retries of a command whose connection dropped
_KEY_CONTEXT = b"dsv4 worker registry record"


class RecordSigner:
    """HMAC-SHA256 of a record's fields (and the key prefix) under a key derived from the
    shared secret (its own context, so a record signature is never a valid token elsewhere)."""

    def __init__(self, secret: str, prefix: str) -> None:
        if not secret:
            raise ConfigError(
                "security.shared_secret", "", "the Redis registry signs worker records with it: "
                "set the same secret (env DSV4_SHARED_SECRET) on the router and every worker",
            )  # fmt: skip
        self._key = hmac.new(secret.encode(), _KEY_CONTEXT, hashlib.sha256).digest()
        self._prefix = prefix

    def sign(self, fields: dict[str, str]) -> str:
        message = json.dumps([self._prefix, fields], sort_keys=True, separators=(",", ":"))
        digest = hmac.new(self._key, message.encode(), hashlib.sha256).hexdigest()
        return f"{SIGNATURE_VERSION}:{digest}"

    def verify(self, fields: dict[str, str]) -> bool:
        """True when `fields` (with its `sig`) was signed with this secret and prefix."""
        unsigned = {k: v for k, v in fields.items() if k != SIGNATURE_FIELD}
        return hmac.compare_digest(fields.get(SIGNATURE_FIELD, ""), self.sign(unsigned))


class RedisWorkerRegistry:
    def __init__(
        self,
        url: str,
        *,
        secret: str,
        prefix: str = "dsv4",
        ttl_s: float = 5.0,
        refresh_interval_s: float = 0.5,
        socket_timeout_s: float = 0.5,
        max_backoff_s: float = 5.0,
    ) -> None:
        self._prefix = prefix
        self._signer = RecordSigner(secret, prefix)
        self._refused: dict[str, str] = {}  # worker id -> why its record is ignored (logged once)
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._refresh_interval_s = refresh_interval_s
        self._max_backoff_s = max_backoff_s
        self._client = redis_lib.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(
                ExponentialBackoff(cap=0.2, base=0.02), RETRIES, (redis_lib.ConnectionError,)
            ),
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
        fields = record.to_fields()
        fields[SIGNATURE_FIELD] = self._signer.sign(fields)
        try:
            with self._client.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping=fields)
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
        self._refused = {k: v for k, v in self._refused.items() if k in worker_ids}
        for worker_id, fields in zip(worker_ids, hashes):
            if not fields:
                expired.append(worker_id)
                continue
            record = self._checked(worker_id, fields)
            if record is not None:
                records.append(record)
        if expired:
            # NOTE: a worker that re-publishes right now re-adds itself on its next heartbeat.
            self._client.srem(self._index_key, *expired)
        return records

    def _checked(self, worker_id: str, fields: dict[str, str]) -> WorkerRecord | None:
        """The record if it is signed with our secret and names its own key; else None,
        logged once per worker id and reason."""
        if not self._signer.verify(fields):
            why = "unsigned" if SIGNATURE_FIELD not in fields else "signature does not match"
            return self._refuse(worker_id, f"{why} (forged, altered, or another secret)")
        try:
            record = WorkerRecord.from_fields(fields)
        except InvalidRequest as exc:
            return self._refuse(worker_id, str(exc))
        if record.worker_id != worker_id:
            return self._refuse(worker_id, f"signed for worker {record.worker_id!r}")
        self._refused.pop(worker_id, None)
        return record

    def _refuse(self, worker_id: str, why: str) -> None:
        if self._refused.get(worker_id) != why:
            logger.warning("redis registry: ignoring the record of %r: %s", worker_id, why)
        self._refused[worker_id] = why
        return None

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
