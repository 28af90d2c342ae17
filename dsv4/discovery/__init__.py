"""Worker discovery: who the prefill and decode workers are, and how loaded.

Reading path: `base.py` (`WorkerRecord`, `PoolView`, the `WorkerRegistry` contract and the
`WorkerHeartbeat` thread), `redis.py` (TTL heartbeats), `static.py` (fixed address lists).
"""

from __future__ import annotations

from dsv4.discovery.base import ROLES, PoolView, WorkerHeartbeat, WorkerRecord, WorkerRegistry

__all__ = [
    "ROLES",
    "PoolView",
    "WorkerHeartbeat",
    "WorkerRecord",
    "WorkerRegistry",
    "make_registry",
]


def make_registry(
    *,
    redis_url: str | None = None,
    prefill: str = "",
    decode: str = "",
    secret: str = "",
    **options: float,
) -> WorkerRegistry:
    """Redis registry when `redis_url` is given (its records signed with `secret`, the shared
    secret), else the static `--prefill/--decode` lists."""
    if redis_url:
        from dsv4.discovery.redis import RedisWorkerRegistry

        return RedisWorkerRegistry(redis_url, secret=secret, **options)
    from dsv4.discovery.static import StaticWorkerRegistry

    return StaticWorkerRegistry.from_flags(prefill, decode)
