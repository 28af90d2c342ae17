"""The ranks of one model replica and the one collective the sharded model needs.

A replica's ranks each run the whole forward on the same tokens; the sharded layers
(`dsv4.parallel.shard`) hold a slice of the weights and sum their partial outputs with
`ParallelGroup.all_reduce_fp32`. On CPU the group is gloo over 127.0.0.1; on CUDA devices NCCL.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from dsv4.errors import ConfigError

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ParallelGroup:
    """This process's place in a replica. `process_group` None means the default group (or no
    group at all when `world_size` is 1: every collective is then the identity)."""

    rank: int
    world_size: int
    process_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    backend: str = "none"

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError("world_size", self.world_size, "use 1 or more ranks per replica")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError("rank", self.rank, f"must be in [0, {self.world_size})")

    @classmethod
    def single(cls) -> ParallelGroup:
        """One process holds the whole model (no torch.distributed needed)."""
        return cls(rank=0, world_size=1)

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    def all_reduce_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (same shape on all ranks), accumulated in fp32 and cast
        back to x.dtype. NOTE: an fp32 `x` is reduced in place; the caller must not reuse it.
        Raises torch.distributed's error when a peer is gone or the group timeout passes."""
        if self.is_single:
            return x
        acc = x.float().contiguous()
        dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=self.process_group)
        return acc.to(x.dtype)


def default_backend(device: torch.device | str) -> str:
    """nccl for CUDA devices, gloo for everything else."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def launch_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a rank process we start: NVLink multicast (NVLS) off for NCCL, and
    gloo on the loopback interface so the ranks of a test never leave the host."""
    env = dict(os.environ if base is None else base)
    env["NCCL_NVLS_ENABLE"] = "0"
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def init_cpu_group(
    rank: int,
    world_size: int,
    port: int,
    *,
    backend: str | None = None,
    device: torch.device | str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ParallelGroup:
    """Join the replica's default process group, rendezvous at tcp://127.0.0.1:`port` (rank 0
    listens there). Every rank must call it; it blocks until all `world_size` ranks have joined
    or raises after `timeout_s`, which also bounds every later collective. `backend` defaults
    to nccl on CUDA devices, gloo otherwise. Pair with `close_group`."""
    ParallelGroup(rank, world_size)  # validates rank and world size before any rendezvous
    if not 0 < port < 65536:
        raise ConfigError("port", port, "give a free TCP port in 1..65535")
    backend = backend or default_backend(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return ParallelGroup(rank, world_size, dist.group.WORLD, backend)


def close_group(group: ParallelGroup) -> None:
    """Destroy the default process group if this process joined one (safe to call twice)."""
    if not group.is_single and dist.is_initialized():
        dist.destroy_process_group()
