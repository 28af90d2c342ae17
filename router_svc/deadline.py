"""Deadline arithmetic of one request (pure; clocks are arguments so tests pin them).

A request's deadline is the router's `request_timeout_s` or the client's own gRPC deadline,
whichever is sooner. Each worker call gets the time left, capped per leg (the prefill leg by
`prefill_timeout_s`); workers also receive the deadline as `deadline_unix_ms` so they can stop
on their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4.errors import DeadlineExceeded


@dataclass(frozen=True, slots=True)
class Deadline:
    timeout_s: float  # what the request was given
    expires_at_s: float  # monotonic clock
    expires_at_unix_ms: int  # wall clock, for workers

    @classmethod
    def start(
        cls,
        *,
        config_timeout_s: float,
        client_remaining_s: float | None,
        now_s: float,
        now_unix_s: float,
    ) -> Deadline:
        """`client_remaining_s`: grpc's `context.time_remaining()` (None: no client deadline)."""
        timeout_s = config_timeout_s
        if client_remaining_s is not None:
            timeout_s = max(0.0, min(timeout_s, client_remaining_s))
        return cls(timeout_s, now_s + timeout_s, int((now_unix_s + timeout_s) * 1000))

    def remaining_s(self, now_s: float) -> float:
        return max(0.0, self.expires_at_s - now_s)

    def call_timeout_s(self, now_s: float, cap_s: float | None = None) -> float:
        """Timeout of the next worker call; raises DeadlineExceeded when no time is left."""
        remaining_s = self.remaining_s(now_s)
        if remaining_s <= 0.0:
            raise self.exceeded()
        return remaining_s if cap_s is None else min(cap_s, remaining_s)

    def exceeded(self) -> DeadlineExceeded:
        return DeadlineExceeded(
            f"the request did not finish within its deadline of {self.timeout_s:.1f} s: raise "
            "the client's deadline or router.request_timeout_s, or lower max_new_tokens"
        )
