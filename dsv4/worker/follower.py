"""A follower rank of a worker's model replica: `python -m dsv4.worker.follower --rank R ...`.

Started only by rank 0 (`dsv4.parallel.ranks.RankGroup.start`), which writes to this process's
stdin, in order: its `ServeConfig` (resolved, this rank's device), later an `EngineSetup` (rank
0's engine options), then one `StepMessage` per engine step and finally a `StopMessage`. The
follower joins the group, loads the model and keeps its shard, builds rank 0's forward on it
(`build_model_runner`: the same KV pool, forward, switches and decode graphs) and executes
every step on its shard. It owns no scheduler, KV manager, transport, tokenizer or server:
rank 0 does.

Exit: 0 after a StopMessage; 3 when the pipe ends (rank 0 is gone); 1 when a step or a
collective fails (a peer died, the group timeout passed). Rank 0 then sees this rank exit and
takes the worker down. It also gets SIGTERM if rank 0 dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import logging
import os
import signal
import sys

import torch

from dsv4.config import ServeConfig
from dsv4.engine.core import build_model_runner
from dsv4.model.fp8 import set_linear_activations_
from dsv4.parallel.group import close_group, init_cpu_group
from dsv4.parallel.paged import rank_collectives
from dsv4.parallel.ranks import backend_of
from dsv4.parallel.shard import shard_model
from dsv4.parallel.step_broadcast import (
    EngineSetup,
    StepMessage,
    StopMessage,
    apply_step,
    read_message,
)
from dsv4.runner.model_runner import ModelRunner
from dsv4.worker.build import load_weights
from dsv4.worker.options import apply_features

logger = logging.getLogger("dsv4.follower")

EXIT_STOPPED, EXIT_FAILED, EXIT_ORPHANED = 0, 1, 3


def build_follower_runner(config: ServeConfig, group, pipe) -> ModelRunner:
    """This rank's shard, run by rank 0's forward (`EngineSetup` from `pipe`) on its device."""
    model, model_cfg, _ = load_weights(config)
    set_linear_activations_(model, config.features.linear_activations)
    expert_parallel = config.model.expert_parallel
    shard_model(model, group, expert_parallel=expert_parallel)
    apply_features(model, model_cfg, config)
    setup = read_message(pipe)
    if not isinstance(setup, EngineSetup):
        raise SystemExit(EXIT_ORPHANED)  # rank 0 failed before sizing its pool
    # rank 0 counts expert popularity (the routing is the same on every rank)
    options = dataclasses.replace(setup.options, device=config.model.device, routing_stats=False)
    collectives = rank_collectives(group, expert_parallel=expert_parallel)
    return build_model_runner(model, options, collectives)


def serve_steps(pipe, runner: ModelRunner, group) -> int:
    """Execute every step rank 0 sends until it says stop (0) or its pipe ends (3)."""
    while True:
        message = read_message(pipe)
        if message is None:
            logger.error("rank %d: rank 0 is gone (pipe closed): exiting", group.rank)
            return EXIT_ORPHANED
        if isinstance(message, StopMessage):
            return EXIT_STOPPED
        if isinstance(message, StepMessage):
            apply_step(runner, message, group)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsv4.worker.follower")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: go with rank 0
    if os.getppid() != args.parent_pid:
        return EXIT_ORPHANED
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank {args.rank} %(message)s")
    pipe = sys.stdin.buffer
    config = read_message(pipe)
    if not isinstance(config, ServeConfig):
        return EXIT_ORPHANED
    if not config.model.device.startswith("cuda"):
        torch.set_num_threads(1)
    m = config.model
    if m.device.startswith("cuda"):  # streams, graph captures and Triton launch on this device
        torch.cuda.set_device(torch.device(m.device))
    group = init_cpu_group(args.rank, args.world_size, args.port, backend=backend_of(config),
                           device=m.device, timeout_s=m.collective_timeout_s)  # fmt: skip
    try:
        with torch.no_grad():
            runner = build_follower_runner(config, group, pipe)
            return serve_steps(pipe, runner, group)
    except Exception:
        logger.exception("rank %d failed: exiting (rank 0 takes the worker down)", args.rank)
        return EXIT_FAILED
    finally:
        close_group(group)


if __name__ == "__main__":
    sys.exit(main())
