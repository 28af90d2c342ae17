"""Static registry: fixed --prefill/--decode lists, plus the record type's validation."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from dsv4.discovery import WorkerHeartbeat, WorkerRecord, make_registry
from dsv4.discovery.static import StaticWorkerRegistry
from dsv4.errors import ConfigError, InvalidRequest


def test_lists_fixed_addresses_by_role() -> None:
    registry = make_registry(prefill="127.0.0.1:50061, 127.0.0.1:50062", decode="10.0.0.5:50071")
    assert isinstance(registry, StaticWorkerRegistry)
    prefill = registry.list("prefill")
    assert [w.address for w in prefill.workers] == ["127.0.0.1:50061", "127.0.0.1:50062"]
    assert not prefill.is_stale
    assert [w.worker_id for w in registry.list("decode").workers] == ["decode@10.0.0.5:50071"]
    assert registry.refresh()


def test_publish_updates_and_draining_is_honoured() -> None:
    registry = StaticWorkerRegistry(["h:1"], ["h:2", "h:3"])
    drained = dataclasses.replace(registry.list("decode").workers[0], draining=True, free_blocks=9)
    registry.publish(drained)
    assert [w.address for w in registry.list("decode").workers] == ["h:3"]
    assert registry.list("decode", include_draining=True).workers[0].free_blocks == 9
    registry.withdraw("decode@h:3")
    assert registry.list("decode").workers == ()


@pytest.mark.parametrize("value", ["localhost", "h:port", ":50051", "h:70000"])
def test_bad_address_names_the_flag(value: str) -> None:
    with pytest.raises(ConfigError, match="--prefill"):
        StaticWorkerRegistry.from_flags(value, "")


def test_record_validation() -> None:
    with pytest.raises(InvalidRequest, match="role"):
        WorkerRecord("router", "w", "h:1")
    with pytest.raises(InvalidRequest):
        WorkerRecord("decode", "", "h:1")
    with pytest.raises(InvalidRequest, match="malformed"):
        WorkerRecord.from_fields(
            {"role": "decode", "worker_id": "w", "address": "h:1", "free_blocks": "x"}
        )


def test_heartbeat_thread_is_owned_and_stops() -> None:
    registry = StaticWorkerRegistry([], [])
    calls = threading.Event()

    def make_record() -> WorkerRecord:
        calls.set()
        return WorkerRecord("prefill", "p0", "h:1")

    heartbeat = WorkerHeartbeat(registry, make_record, interval_s=0.05)
    heartbeat.start()
    assert calls.wait(5.0)
    heartbeat.stop(withdraw=True, worker_id="p0")
    assert registry.list("prefill").workers == ()
    assert not any(t.name == "worker-heartbeat" for t in threading.enumerate())


def test_heartbeat_survives_a_failing_record_source() -> None:
    registry = StaticWorkerRegistry([], [])
    heartbeat = WorkerHeartbeat(registry, lambda: 1 / 0, interval_s=0.01)
    assert heartbeat.beat() is False
    assert heartbeat.num_published == 0
