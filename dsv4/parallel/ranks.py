"""The rank processes of one worker's model replica: start, step, watch, stop (rank 0's side).

`dsv4 prefill|decode --tensor-parallel-size T` makes the worker process rank 0 of T. Before it
loads weights, `RankGroup.start` spawns ranks 1..T-1 (`python -m dsv4.worker.follower`, same
interpreter, environment from `launch_env`), hands each the resolved config over its stdin pipe
and joins them in a torch.distributed group rendezvousing at a free loopback port (gloo on CPU,
nccl on CUDA unless `model.distributed_backend` says otherwise). Every rank then loads the
model and keeps its shard (`shard_model`: heads, and experts whole with `--expert-parallel` or
sliced without); rank 0 alone owns the gRPC servicer, scheduler, KV manager and transport.
Rank 0 sends its engine options (`EngineSetup`) and every rank builds the same forward from
them (`build_model_runner`: reference or paged, the paged one with this rank's collective
hooks, `dsv4.parallel.paged`).

Each engine step, `RankZeroRunner.execute` sends the batch (`StepMessage`) down every pipe and
then runs rank 0's own shard; the followers run theirs (`dsv4.worker.follower`). Blocks that
the transport wrote into rank 0's cache (a decode worker's pulls) are recorded by
`RankedEngineCore.activate` and copied to the other ranks before the next forward.

Failure: the worker polls `RankGroup.dead_ranks` (`dsv4.commands.worker`); a follower that
exits makes health NOT_SERVING at once and the worker drain and exit. Every collective is
bounded by `model.collective_timeout_s`, and a follower whose pipe ends (rank 0 gone) exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch

from dsv4.config import ServeConfig
from dsv4.engine.core import EngineCore, EngineOptions
from dsv4.errors import ConfigError, RankFailed
from dsv4.parallel.group import ParallelGroup, close_group, init_cpu_group, launch_env
from dsv4.parallel.paged import rank_collectives
from dsv4.parallel.step_broadcast import (
    EngineSetup,
    StepMessage,
    StopMessage,
    broadcast_blocks,
    write_message,
)
from dsv4.runner.paged.collectives import PagedCollectives
from dsv4.scheduler.batch import ScheduledBatch, StepOutput
from dsv4.scheduler.request import Request

logger = logging.getLogger(__name__)

STOP_GRACE_S = 5.0


def check_rank_config(config: ServeConfig) -> None:
    """Refuse what a replica of several ranks cannot run yet (ConfigError, one line)."""
    m = config.model
    if m.tensor_parallel_size == 1:
        return
    if config.speculative.method != "none":
        raise ConfigError("speculative.method", config.speculative.method, "MTP speculation "
                          "is not sharded yet: use none with tensor_parallel_size > 1")  # fmt: skip
    if m.distributed_backend == "nccl" and not m.device.startswith("cuda"):
        raise ConfigError("model.distributed_backend", "nccl", "nccl needs CUDA: use gloo")


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:(first + r) mod the visible GPUs (several ranks share a GPU only
    when there are fewer GPUs than ranks, which gloo allows); cpu stays cpu."""
    if not device.startswith("cuda"):
        return device
    first = int(device.partition(":")[2] or 0)
    return f"cuda:{(first + rank) % max(1, torch.cuda.device_count())}"


def rank_config(config: ServeConfig, rank: int) -> ServeConfig:
    """Rank r's copy of the (resolved) config: its own device."""
    model = dataclasses.replace(config.model, device=rank_device(config.model.device, rank))
    return dataclasses.replace(config, model=model)


def backend_of(config: ServeConfig) -> str:
    chosen = config.model.distributed_backend
    if chosen != "auto":
        return chosen
    return "nccl" if config.model.device.startswith("cuda") else "gloo"


@dataclass
class RankGroup:
    """Rank 0's handle on its replica: the group and the follower processes (owned here)."""

    group: ParallelGroup
    followers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _closed: bool = False

    @classmethod
    def start(cls, config: ServeConfig, port: int) -> RankGroup:
        """Spawn ranks 1..T-1 and join them (blocks until all joined, at most
        `collective_timeout_s`; then raises RankFailed and stops what started)."""
        check_rank_config(config)
        m = config.model
        world = m.tensor_parallel_size
        env = launch_env()
        env.setdefault("OMP_NUM_THREADS", "1")
        ranks = cls(ParallelGroup.single())
        try:
            for rank in range(1, world):
                command = [sys.executable, "-m", "dsv4.worker.follower", "--rank", str(rank),
                           "--world-size", str(world), "--port", str(port),
                           "--parent-pid", str(os.getpid())]  # fmt: skip
                proc = subprocess.Popen(command, stdin=subprocess.PIPE, env=env)
                ranks.followers.append(proc)
                write_message(proc.stdin, rank_config(config, rank))
            ranks.group = init_cpu_group(0, world, port, backend=backend_of(config),
                                         device=m.device, timeout_s=m.collective_timeout_s)  # fmt: skip
        except BaseException as exc:
            ranks.close(f"start-up failed: {exc}")
            if isinstance(exc, Exception) and not isinstance(exc, ConfigError):
                raise RankFailed(f"the {world} ranks did not start: {exc}") from exc
            raise
        logger.info("rank 0 of %d joined (%s, port %d)", world, ranks.group.backend, port)
        return ranks

    @property
    def world_size(self) -> int:
        return len(self.followers) + 1

    def dead_ranks(self) -> list[tuple[int, int]]:
        """(rank, exit status) of every follower that has exited."""
        codes = ((r, p.poll()) for r, p in enumerate(self.followers, start=1))
        return [(r, code) for r, code in codes if code is not None]

    @property
    def all_alive(self) -> bool:
        return not self._closed and not self.dead_ranks()

    def send(self, message: object) -> None:
        """Write `message` to every follower; raises RankFailed naming a rank that is gone."""
        for rank, proc in enumerate(self.followers, start=1):
            try:
                write_message(proc.stdin, message)
            except (OSError, ValueError) as exc:
                raise RankFailed(f"rank {rank} of {self.world_size} is gone ({exc})") from exc

    def close(self, reason: str = "worker stopping") -> None:
        """Tell the followers to stop, wait up to STOP_GRACE_S, kill the rest; leave the
        group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for proc in self.followers:
            with contextlib.suppress(OSError, ValueError):
                write_message(proc.stdin, StopMessage(reason))
            with contextlib.suppress(OSError):
                proc.stdin.close()
        give_up_s = time.monotonic() + STOP_GRACE_S
        for proc in self.followers:
            try:
                proc.wait(timeout=max(0.1, give_up_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        close_group(self.group)


class RankZeroRunner:
    """Rank 0's `ModelRunner` in a replica of several ranks: each `execute` first sends the
    batch (and the blocks pulled since the last step) to the followers, copies those blocks to
    them, then runs rank 0's shard. Everything else is the wrapped runner's."""

    def __init__(self, runner: object, ranks: RankGroup) -> None:
        self.runner = runner
        self.ranks = ranks
        self.pulled_block_ids: list[int] = []  # written and read on the engine thread

    def __getattr__(self, name: str) -> object:
        return getattr(self.runner, name)

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        if not self.ranks.all_alive:
            raise RankFailed(f"ranks {self.ranks.dead_ranks()} of this worker exited")
        pulled = tuple(self.pulled_block_ids)
        self.pulled_block_ids.clear()
        self.ranks.send(StepMessage(batch, pulled))
        broadcast_blocks(self.runner.cache, pulled, self.ranks.group)
        return self.runner.execute(batch)


class RankedEngineCore(EngineCore):
    """`EngineCore` of rank 0: also notes the blocks a pulled request's KV landed in, so the
    next step copies them to the other ranks before any forward reads them."""

    def __init__(self, core: EngineCore, ranks: RankGroup) -> None:
        # async scheduling stays off (the new core's default): a step launched ahead would
        # bypass `RankZeroRunner.execute`, so the followers would never see it
        super().__init__(core.scheduler, RankZeroRunner(core.runner, ranks), core.vocab_size)
        self._adopted_blocks: dict[str, tuple[int, ...]] = {}

    def adopt(self, request: Request) -> tuple[int, ...]:
        block_ids = super().adopt(request)
        self._adopted_blocks[request.request_id] = block_ids
        return block_ids

    def activate(self, request_id: str) -> None:
        super().activate(request_id)
        self.runner.pulled_block_ids.extend(self._adopted_blocks.pop(request_id, ()))

    def abandon(self, request_id: str) -> None:
        self._adopted_blocks.pop(request_id, None)
        super().abandon(request_id)


def rank_zero_setup(
    ranks: RankGroup, options: EngineOptions, *, expert_parallel: bool
) -> PagedCollectives:
    """Send the followers the engine options (before rank 0 builds its runner: graph captures
    run on every rank at once) and return rank 0's paged-forward hooks."""
    ranks.send(EngineSetup(options))
    return rank_collectives(ranks.group, expert_parallel=expert_parallel)


def rank_zero_core(core: EngineCore, ranks: RankGroup) -> EngineCore:
    """Wrap rank 0's freshly built core (`rank_zero_setup` came first)."""
    return RankedEngineCore(core, ranks)
