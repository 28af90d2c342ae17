"""`StepWatch`: how long the engine step in progress has run, and the watchdog's verdict on it.

The engine thread stamps each step (`begin` / `end`); the watchdog (an asyncio task of
`AsyncEngine`) asks `declare` now and then. A step that has run past `timeout_s` is declared
hung once: `declare` calls the engine's `condemn` (it ends the live requests) under the same
lock `end` takes, so a step that returns just as it is declared is either on time (its outputs
delivered) or hung (its outputs dropped, `end` hands back the verdict), never both.

`is_hung` reads the stamp alone (any thread, no lock): True from the moment the step in progress
passes the timeout until it returns, whether or not the watchdog has acted yet.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class HungStep:
    """The verdict on one step: how long it had run, its requests, and every request the
    engine ended for it (the step's and those of every live stream; the engine thread aborts
    them once the step returns)."""

    elapsed_s: float
    step_request_ids: tuple[str, ...]
    ended_request_ids: tuple[str, ...]


class StepWatch:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s  # 0: never declared hung
        self._lock = threading.Lock()
        self._started_s: float | None = None  # monotonic start of the step in progress
        self._verdict: HungStep | None = None  # on the step in progress

    # ---- the engine thread -------------------------------------------------------------------
    def begin(self) -> None:
        with self._lock:
            self._started_s = time.monotonic()
            self._verdict = None

    def end(self) -> HungStep | None:
        """The step returned (or raised): its verdict if it was declared hung, else None."""
        with self._lock:
            self._started_s = None
            verdict, self._verdict = self._verdict, None
            return verdict

    # ---- any thread ----------------------------------------------------------------------------
    def elapsed_s(self) -> float:
        """Seconds the step in progress has run (0: none in progress)."""
        started = self._started_s
        return 0.0 if started is None else time.monotonic() - started

    @property
    def is_hung(self) -> bool:
        return self.timeout_s > 0 and self.elapsed_s() > self.timeout_s

    # ---- the watchdog ------------------------------------------------------------------------
    def declare(self, condemn: Callable[[float], HungStep]) -> HungStep | None:
        """If the step in progress is hung and has no verdict yet: `condemn(elapsed_s)` under
        the lock (it must not block: it ends streams and calls, nothing else) and keep its
        verdict for `end`. Returns the new verdict, else None."""
        with self._lock:
            if self._verdict is not None or not self.is_hung:
                return None
            self._verdict = condemn(self.elapsed_s())
            return self._verdict
