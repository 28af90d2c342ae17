"""Who may call the router and how much: API keys, in-flight admission, per-client rate limits.

All pure Python, used by the servicer on the event loop before any work starts on a request.
Refusals raise `Unauthenticated` or `ResourceExhausted` (with `retry_after_s`), which
`dsv4.errors.to_grpc_status` maps to UNAUTHENTICATED and RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from dsv4.errors import ResourceExhausted, Unauthenticated

AUTHORIZATION_KEY = "authorization"
_BEARER = "bearer "


def check_api_key(
    metadata: Iterable[tuple[str, str | bytes]], api_keys: tuple[str, ...]
) -> str | None:
    """The caller's API key from `authorization: Bearer KEY`; None when keys are off.

    Raises Unauthenticated when keys are configured and the caller sent none or a wrong one.
    Keys are compared in constant time.
    """
    if not api_keys:
        return None
    sent = next((str(v) for k, v in metadata if k.lower() == AUTHORIZATION_KEY), "")
    if not sent:
        raise Unauthenticated(
            "this router needs an API key: send metadata 'authorization: Bearer KEY'"
        )
    if not sent.lower().startswith(_BEARER):
        raise Unauthenticated("malformed authorization metadata: send 'Bearer KEY'")
    key = sent[len(_BEARER) :].strip()
    if not any(hmac.compare_digest(key.encode(), k.encode()) for k in api_keys):
        raise Unauthenticated("unknown API key: check the key the router was configured with")
    return key


def client_key(api_key: str | None, peer: str) -> str:
    """Rate-limit bucket of a caller: its API key, else its host ('ipv4:10.0.0.1:5432' -> host)."""
    if api_key:
        return f"key:{_digest(api_key)}"
    kind, _, rest = peer.partition(":")
    host = rest.rpartition(":")[0] if kind in ("ipv4", "ipv6") else peer
    return f"peer:{host}"


def _digest(text: str) -> str:
    """Short stable digest so keys never sit in memory maps or logs verbatim."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class AdmissionTicket:
    """One admitted request; `release()` (or leaving the `with` block) frees its slot once."""

    def __init__(self, gate: AdmissionGate) -> None:
        self._gate: AdmissionGate | None = gate

    def release(self) -> None:
        if self._gate is not None:
            self._gate.num_inflight -= 1
            self._gate = None

    def __enter__(self) -> AdmissionTicket:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class AdmissionGate:
    """At most `max_inflight` Generate calls at once; the next one gets RESOURCE_EXHAUSTED."""

    def __init__(self, max_inflight: int, retry_after_s: float = 1.0) -> None:
        self.max_inflight = max_inflight
        self.retry_after_s = retry_after_s
        self.num_inflight = 0

    def admit(self) -> AdmissionTicket:
        if self.num_inflight >= self.max_inflight:
            raise ResourceExhausted(
                f"the router is at its limit of {self.max_inflight} requests in flight "
                "(router.max_inflight_requests): retry later or add capacity",
                retry_after_s=self.retry_after_s,
            )
        self.num_inflight += 1
        return AdmissionTicket(self)


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated_at_s: float


class TokenBucketLimiter:
    """Per-client token buckets: `rate_per_s` refill, `burst` capacity. Off when rate is 0.

    Buckets live in an LRU map of at most `max_clients` entries, so a flood of distinct peers
    cannot grow memory without bound (an evicted client simply starts with a full bucket).
    """

    def __init__(
        self,
        rate_per_s: float,
        burst: int = 0,
        *,
        max_clients: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst or max(1, math.ceil(rate_per_s))
        self._max_clients = max_clients
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    @property
    def is_enabled(self) -> bool:
        return self.rate_per_s > 0

    def acquire(self, key: str, cost: int = 1) -> None:
        """Take `cost` tokens for `key` at once (all or none: the HTTP front's choices of one
        request); raises ResourceExhausted with the wait until there are that many."""
        if not self.is_enabled:
            return
        now_s = self._clock()
        bucket = self._buckets.pop(key, None) or _Bucket(float(self.burst), now_s)
        bucket.tokens = min(
            self.burst, bucket.tokens + (now_s - bucket.updated_at_s) * self.rate_per_s
        )
        bucket.updated_at_s = now_s
        self._buckets[key] = bucket  # most recently used last
        while len(self._buckets) > self._max_clients:
            self._buckets.popitem(last=False)
        if bucket.tokens < cost:
            wait_s = (cost - bucket.tokens) / self.rate_per_s
            raise ResourceExhausted(
                f"rate limit of {self.rate_per_s:g} requests/s (burst {self.burst}) exceeded "
                "for this client (router.rate_limit_rps): slow down",
                retry_after_s=wait_s,
            )
        bucket.tokens -= cost
