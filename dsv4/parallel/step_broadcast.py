"""What rank 0 of a replica sends its follower ranks, and how every rank applies it.

Rank 0 (the worker: gRPC servicer, scheduler, KV manager) writes one message per engine step
to each follower's stdin pipe; every rank then runs the same `ModelRunner.execute` on its shard
and the sharded layers' all-reduces keep them in step. The messages are frozen dataclasses,
pickled with an 8-byte length prefix (rank 0 is the followers' parent: the pipe is trusted).

Why a pipe and not `broadcast_object_list`: a follower waits for the next step for as long as
the worker is idle, and a collective would time out there (`model.collective_timeout_s` bounds
every collective); a pipe has no deadline and ends with EOF the moment rank 0 is gone, so an
orphaned follower exits instead of hanging. The model's collectives (and the KV block copy
below) stay on torch.distributed, each bounded by the group timeout.

KV: DeepSeek-V4's cache holds one latent KV head shared by all query heads (MQA-like), so it is
not split by heads: every rank computes and caches all of it. Blocks that arrive over the KV
transport land in rank 0's cache only (the one registered with the transport); their ids ride
on the next step's message and rank 0 broadcasts their bytes to the other ranks before that
step's forward (`broadcast_blocks`).
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from typing import BinaryIO

import torch
import torch.distributed as dist

from dsv4.engine.core import EngineOptions
from dsv4.parallel.group import ParallelGroup
from dsv4.runner.kv_cache import PagedKVCache
from dsv4.scheduler.batch import ScheduledBatch

_LENGTH = struct.Struct("<Q")


@dataclass(frozen=True)
class EngineSetup:
    """Sent once, before rank 0 builds its runner: every rank builds the same forward on its
    shard from these options (`build_model_runner`), on its own device, with the same KV pool
    (on CUDA the free memory differs per rank, so followers never size their own), and
    captures the same decode graphs at the same time as rank 0."""

    options: EngineOptions


@dataclass(frozen=True)
class StepMessage:
    """One engine step: the batch every rank executes, and the KV blocks rank 0 received over
    the transport since the last step (copied from rank 0 to every rank first)."""

    batch: ScheduledBatch
    pulled_block_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class StopMessage:
    """The worker is shutting down: leave the step loop and the process group."""

    reason: str


def write_message(stream: BinaryIO, message: object) -> None:
    """Length-prefixed pickle; raises OSError (BrokenPipeError) when the reader is gone."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(payload)) + payload)
    stream.flush()


def read_message(stream: BinaryIO) -> object | None:
    """The next message, or None at EOF (the writer, rank 0, closed the pipe or died)."""
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(header)
    payload = stream.read(length)
    if len(payload) < length:
        return None
    return pickle.loads(payload)


def broadcast_blocks(cache: PagedKVCache, block_ids: tuple[int, ...], group: ParallelGroup) -> None:
    """Copy whole blocks [n, block_stride] of rank 0's cache into every rank's (a collective:
    every rank calls it with the same ids; bounded by the group timeout)."""
    if group.is_single or not block_ids:
        return
    index = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
    rows = cache.backing.index_select(0, index)  # [n, block_stride] uint8; rank 0: the source
    dist.broadcast(rows, src=0, group=group.process_group)
    if group.rank:
        cache.backing.index_copy_(0, index, rows)


def apply_step(runner: object, message: StepMessage, group: ParallelGroup) -> None:
    """A follower's half of one step: the pulled blocks, then the same forward as rank 0 (its
    sampled tokens are dropped: rank 0's scheduler owns the requests)."""
    broadcast_blocks(runner.cache, message.pulled_block_ids, group)
    runner.execute(message.batch)
