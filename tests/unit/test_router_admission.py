"""router_svc.admission and router_svc.deadline: API keys, in-flight admission, token buckets,
deadline arithmetic. Clocks are injected; nothing sleeps."""

from __future__ import annotations

import grpc
import pytest

from dsv4.errors import DeadlineExceeded, ResourceExhausted, Unauthenticated, to_grpc_status
from router_svc.admission import AdmissionGate, TokenBucketLimiter, check_api_key, client_key
from router_svc.deadline import Deadline

KEYS = ("alpha", "beta")


def test_api_keys() -> None:
    assert check_api_key([], ()) is None  # keys off: open
    assert check_api_key([("authorization", "Bearer beta")], KEYS) == "beta"
    assert check_api_key([("Authorization", "bearer  alpha ")], KEYS) == "alpha"
    for metadata in ([], [("authorization", "beta")], [("authorization", "Bearer gamma")]):
        with pytest.raises(Unauthenticated):
            check_api_key(metadata, KEYS)
    code, _ = to_grpc_status(Unauthenticated("x"))
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_client_key_uses_the_api_key_else_the_peer_host() -> None:
    assert client_key(None, "ipv4:10.0.0.7:53211") == "peer:10.0.0.7"
    assert client_key(None, "ipv6:[::1]:4242") == "peer:[::1]"
    assert client_key(None, "unix:/tmp/sock") == "peer:unix:/tmp/sock"
    keyed = client_key("secret", "ipv4:10.0.0.7:1")
    assert keyed.startswith("key:") and "secret" not in keyed


def test_admission_gate_counts_and_releases_once() -> None:
    gate = AdmissionGate(2, retry_after_s=0.5)
    first, second = gate.admit(), gate.admit()
    with pytest.raises(ResourceExhausted) as info:
        gate.admit()
    code, message = to_grpc_status(info.value)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry after 0.5 s" in message
    first.release()
    first.release()  # idempotent
    assert gate.num_inflight == 1
    with gate.admit():
        assert gate.num_inflight == 2
    second.release()
    assert gate.num_inflight == 0


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_token_bucket_burst_refill_and_retry_hint() -> None:
    clock = Clock()
    limiter = TokenBucketLimiter(2.0, burst=3, clock=clock)
    for _ in range(3):
        limiter.acquire("a")
    with pytest.raises(ResourceExhausted) as info:
        limiter.acquire("a")
    assert info.value.retry_after_s == pytest.approx(0.5)
    limiter.acquire("b")  # other clients have their own bucket
    clock.now_s += 0.5
    limiter.acquire("a")
    clock.now_s += 100.0  # refill is capped at the burst
    for _ in range(3):
        limiter.acquire("a")
    with pytest.raises(ResourceExhausted):
        limiter.acquire("a")


def test_token_bucket_takes_several_tokens_all_or_none() -> None:
    clock = Clock()
    limiter = TokenBucketLimiter(2.0, burst=4, clock=clock)
    limiter.acquire("a", cost=3)
    with pytest.raises(ResourceExhausted) as info:
        limiter.acquire("a", cost=2)  # one left: refused, and the one stays
    assert info.value.retry_after_s == pytest.approx(0.5)  # until two are there
    limiter.acquire("a")
    clock.now_s += 1.0
    limiter.acquire("a", cost=2)


def test_token_bucket_is_off_at_rate_zero_and_bounded_in_clients() -> None:
    TokenBucketLimiter(0.0).acquire("anyone")
    limiter = TokenBucketLimiter(1.0, max_clients=2, clock=Clock())
    assert limiter.burst == 1
    for key in ("a", "b", "c"):
        limiter.acquire(key)
    assert len(limiter._buckets) == 2
    limiter.acquire("a")  # "a" was evicted: it starts again with a full bucket


def test_deadline_takes_the_sooner_of_config_and_client() -> None:
    d = Deadline.start(config_timeout_s=600, client_remaining_s=2.5, now_s=10.0, now_unix_s=1000.0)
    assert (d.timeout_s, d.expires_at_s, d.expires_at_unix_ms) == (2.5, 12.5, 1_002_500)
    d = Deadline.start(config_timeout_s=5, client_remaining_s=None, now_s=0.0, now_unix_s=0.0)
    assert d.timeout_s == 5 and d.remaining_s(1.0) == 4.0
    assert d.call_timeout_s(1.0, cap_s=2.0) == 2.0
    assert d.call_timeout_s(4.0, cap_s=2.0) == 1.0
    with pytest.raises(DeadlineExceeded, match=r"within its deadline of 5\.0 s"):
        d.call_timeout_s(5.0)
    past = Deadline.start(config_timeout_s=5, client_remaining_s=-1.0, now_s=0, now_unix_s=0)
    assert past.remaining_s(0.0) == 0.0
