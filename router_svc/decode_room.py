"""How long a request waits for decode room when every decode worker refused it as full.

A decode worker that has no free KV blocks for a hand-off waits briefly, then refuses with
RESOURCE_EXHAUSTED (decode_svc/session.py: it never sits on blocks for a lease's lifetime).
That is load, not a fault: the request's prompt KV is still leased on P and its first token
already streamed, so failing it would make the outcome depend on how busy the pool was. Instead
the router tries the full workers again, pausing `RETRY_INTERVAL_S` between rounds, until
(whichever comes first):
- `router.decode_full_wait_s` has passed since the first refusal (0: fail at once, the old way);
- P's lease on the prompt KV would expire before a decode worker could pull it (the lease's
  expiry less `transfer.pull_timeout_s`); a colocated request has no lease;
- the request's deadline.
Then the client gets RESOURCE_EXHAUSTED with a retry hint, as before. Pure arithmetic over
clocks given as arguments, so tests pin them.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4.types import KVHandle
from router_svc.deadline import Deadline

RETRY_INTERVAL_S = 0.1  # each refusal already took the D's own short wait (ADOPT_WAIT_S)


@dataclass(frozen=True, slots=True)
class DecodeRoomWait:
    give_up_at_s: float  # monotonic: no retry round starts after this

    @classmethod
    def start(
        cls,
        *,
        wait_s: float,
        deadline: Deadline,
        handle: KVHandle | None,
        pull_timeout_s: float,
        now_s: float,
        now_unix_s: float,
    ) -> DecodeRoomWait:
        """From the first full refusal; `handle` None: no lease (colocated)."""
        give_up_at_s = min(now_s + wait_s, deadline.expires_at_s)
        if handle is not None:
            give_up_at_s = min(
                give_up_at_s, now_s + handle.pull_window_s(pull_timeout_s, now_unix_s)
            )
        return cls(give_up_at_s)

    def may_retry(self, now_s: float) -> bool:
        """Whether another round still fits (it starts after `RETRY_INTERVAL_S`)."""
        return now_s + RETRY_INTERVAL_S < self.give_up_at_s
