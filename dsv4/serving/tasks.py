"""`TaskOwner`: the owner of a service's background asyncio tasks (leases, pulls, cleanups).

The one owner for the workers and the router (its Abort / Release cleanups); torch-free, so the
router imports it. Every task started outside a request's own await goes through `spawn`: the
owner keeps a reference (so the task is never garbage-collected mid-flight), logs its exception,
and `close` waits a bounded time, then cancels what is left. Event-loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")


class TaskOwner:
    """Holds background tasks until they finish; `close()` waits a bounded time, then cancels."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro, name=f"{self._name}: {name}")
        self._tasks.add(task)
        task.add_done_callback(self._on_done)
        return task

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s failed", task.get_name(), exc_info=task.exception())

    async def close(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the tasks, then cancel the rest and await them."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def find_leaks(self) -> list[str]:
        return [f"task {t.get_name()} still running" for t in self._tasks]
