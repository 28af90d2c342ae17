"""The worker's routing-stats dumps: `metrics.routing_stats_out`, rewritten every
`metrics.routing_stats_interval_s` by a task the worker owns, and once more at shutdown (after
the engine stopped: the last steps are in it). Each dump is a whole residency file
(`dsv4.plan.residency`, every expert resident) written atomically, the counts since start-up;
`dsv4 plan --routing-stats` turns it into the residency the offload pool reads."""

from __future__ import annotations

import asyncio
import logging

from dsv4.plan.residency import write_residency
from dsv4.worker.build import WorkerRuntime

logger = logging.getLogger(__name__)


def dump_routing_stats(runtime: WorkerRuntime) -> None:
    """Write the counts now (blocking: one device->host copy and a small file)."""
    stats = runtime.engine.core.runner.routing_stats
    path = runtime.config.metrics.routing_stats_out
    if stats is None or not path:
        return
    try:
        write_residency(stats.residency(), path)
    except OSError as exc:  # a full disk must not take the worker down: say so and go on
        logger.warning("routing stats: cannot write %s (%s)", path, exc)


async def dump_periodically(runtime: WorkerRuntime) -> None:
    """Runs until cancelled (the worker's main task owns it)."""
    interval = runtime.config.metrics.routing_stats_interval_s
    while True:
        await asyncio.sleep(interval)
        await asyncio.to_thread(dump_routing_stats, runtime)


def start_dumps(runtime: WorkerRuntime) -> asyncio.Task | None:
    """The periodic dump task, or None when `metrics.routing_stats_out` is unset."""
    if not runtime.config.metrics.routing_stats_out:
        return None
    return asyncio.create_task(dump_periodically(runtime))
