"""Static worker registry: the fixed `--prefill` / `--decode` address lists (the embedded default).

The lists never change; `publish` replaces a known worker's record (for example with load figures
the router learnt from Info calls) and `withdraw` drops one. Never stale.
"""

from __future__ import annotations

import threading
import time

from dsv4.discovery.base import ROLES, PoolView, WorkerRecord
from dsv4.errors import ConfigError, InvalidRequest


def parse_addresses(value: str, flag: str) -> list[str]:
    """ "host:port,host:port" -> list; names the flag in the error."""
    addresses = [part.strip() for part in value.split(",") if part.strip()]
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(flag, value, f"{address!r} is not host:port (e.g. 127.0.0.1:50061)")
    return addresses


class StaticWorkerRegistry:
    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, WorkerRecord] = {}
        for role, addresses in (("prefill", prefill), ("decode", decode)):
            for address in addresses:
                record = WorkerRecord(role, f"{role}@{address}", address, updated_at=time.time())
                self._records[record.worker_id] = record

    @classmethod
    def from_flags(cls, prefill: str, decode: str) -> StaticWorkerRegistry:
        return cls(parse_addresses(prefill, "--prefill"), parse_addresses(decode, "--decode"))

    def publish(self, record: WorkerRecord) -> None:
        with self._lock:
            self._records[record.worker_id] = record

    def withdraw(self, worker_id: str) -> None:
        with self._lock:
            self._records.pop(worker_id, None)

    def list(self, role: str, *, include_draining: bool = False) -> PoolView:
        if role not in ROLES:
            raise InvalidRequest(f"worker role {role!r} must be one of {ROLES}")
        with self._lock:
            workers = tuple(
                record
                for _, record in sorted(self._records.items())
                if record.role == role and (include_draining or not record.draining)
            )
        return PoolView(role, workers, False, time.time())

    def refresh(self) -> bool:
        return True

    def close(self) -> None:
        pass
