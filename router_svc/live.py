"""The owner of what outlives a single await on the router: its live requests.

`LiveRequests` maps request ids to running flows, so Router.Abort and the pool's "worker down"
signal can reach them. Background cleanups (Abort on D, Release on P after a request ended
abnormally) go through the shared `dsv4.serving.tasks.TaskOwner`. Used only on the router's event
loop.
"""

from __future__ import annotations

import hmac
from typing import Protocol

from dsv4.errors import InvalidRequest
from router_svc.clients import WorkerCall


class Interruptible(Protocol):
    request_id: str

    def abort(self) -> None: ...

    def fail_worker(self, address: str, reason: str) -> None: ...


class RequestAborted(Exception):
    """Router.Abort reached this request: its stream ends with FINISH_REASON_ABORT."""


class ActiveCall:
    """The one worker call a request has in flight, so Abort and "worker down" can cancel it."""

    def __init__(self) -> None:
        self.call: WorkerCall | None = None
        self.is_aborted = False

    def abort(self) -> None:
        self.is_aborted = True
        if self.call is not None:
            self.call.interrupt("aborted by Router.Abort")

    def fail_worker(self, address: str, reason: str) -> None:
        if self.call is not None and self.call.address == address:
            self.call.interrupt(reason)

    def check_aborted(self) -> None:
        """Raise RequestAborted once Router.Abort was called (between calls and messages)."""
        if self.is_aborted:
            raise RequestAborted()


class LiveRequests:
    """Running flows by request id, each with its owner: the caller's API-key bucket
    (`admission.client_key`), or None when the router has no API keys."""

    def __init__(self) -> None:
        self._flows: dict[str, Interruptible] = {}
        self._owners: dict[str, str | None] = {}

    def __len__(self) -> int:
        return len(self._flows)

    def add(self, flow: Interruptible, owner: str | None = None) -> None:
        """Register a flow; a request id that is already running is the client's error."""
        if flow.request_id in self._flows:
            raise InvalidRequest(
                f"request_id {flow.request_id!r} is already running: use a unique id per request"
            )
        self._flows[flow.request_id] = flow
        self._owners[flow.request_id] = owner

    def remove(self, flow: Interruptible) -> None:
        if self._flows.get(flow.request_id) is flow:
            del self._flows[flow.request_id]
            del self._owners[flow.request_id]

    def abort(self, request_id: str, caller: str | None = None) -> bool:
        """Router.Abort: True when the request was running (its stream ends with ABORT).

        With API keys only the key that made the request may abort it. Another key's Abort is
        answered exactly like an unknown id (was_found = false, the NOT_FOUND answer), not
        PERMISSION_DENIED, so no key learns which request ids other keys are running."""
        flow = self._flows.get(request_id)
        owner = self._owners.get(request_id)
        if flow is None or (owner is not None and not _same(owner, caller)):
            return False
        flow.abort()
        return True

    def fail_worker(self, address: str, reason: str) -> None:
        """The pool marked a worker down: every flow with a call on it gives up that call."""
        for flow in list(self._flows.values()):
            flow.fail_worker(address, reason)

    def find_leaks(self) -> list[str]:
        return [f"request {rid} still registered" for rid in self._flows]


def _same(owner: str, caller: str | None) -> bool:
    return caller is not None and hmac.compare_digest(owner.encode(), caller.encode())
