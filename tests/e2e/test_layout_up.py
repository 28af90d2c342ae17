"""`dsv4 up --layout` as a user runs it: `--layout colocated` starts one colocated worker (no
prefill pool) that serves the single engine's greedy tokens, and `--layout auto` under a
`--device-memory-gib` card too small for two copies of the tiny model picks colocated and
says why in its first line. Each ends with a leak check over the worker's Info."""

from __future__ import annotations

import ast
import asyncio
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from e2e_cluster import generate, greedy

from dsv4 import wire
from dsv4.commands.cluster import free_port
from dsv4.commands.service_args import service_config
from dsv4.config.resolve import resolve_auto
from dsv4.rpc.v1 import worker_pb2, worker_pb2_grpc
from dsv4.types import WorkerRole
from dsv4.worker.fit import GIB, planned_model_config, startup_plan
from tests.services.worker_cluster import (
    METADATA,
    PROMPTS,
    WORKER_ARGS,
    single_engine_outputs,
    tiny_checkpoint,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
MAX_NEW_TOKENS = 5
CPU = ("--device", "cpu")


def card_gib_for_one_copy(model_dir: Path) -> float:
    """A card (GiB) where one worker at --memory-fraction 0.9 has 1.5x what it needs, so two
    at 0.45 each have 0.75x: auto must go colocated."""
    config = service_config(("--model", str(model_dir), *WORKER_ARGS, *CPU), {})
    config = resolve_auto(config, has_cuda=False, hostname="test", pid=0)
    needed = startup_plan(config, planned_model_config(config), 1 << 40).needed_bytes
    return 1.5 * needed / config.cache.memory_fraction / GIB


def up(model_dir: Path, log_dir: Path, *flags: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "dsv4.commands.cli", "up", "--port", str(free_port()),
               "--model", str(model_dir), "--log-dir", str(log_dir), "--grace-s", "5",
               *WORKER_ARGS, *flags]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def started(process: subprocess.Popen[str], log_dir: Path) -> tuple[str, str]:
    """(the plan line, the `dsv4 cluster up:` line) that `dsv4 up` printed."""
    plan = process.stdout.readline()  # type: ignore[union-attr]
    ready = process.stdout.readline()  # type: ignore[union-attr]
    logs = "\n".join(p.read_text()[-1500:] for p in sorted(log_dir.glob("*.log")))
    assert ready.startswith("dsv4 cluster up:"), (plan, ready, logs)
    return plan.strip(), ready


def pools(ready: str) -> dict[str, list[str]]:
    """The prefill and decode address lists the start-up line names."""
    return {role: ast.literal_eval(re.search(rf"{role} (\[[^\]]*\])", ready).group(1))  # type: ignore[union-attr]
            for role in ("prefill", "decode")}  # fmt: skip


async def serve_and_check(ready: str, worker: str) -> list[int]:
    """One greedy request through the router, then the worker's Info: colocated, and every
    block free with nothing running (the leak check)."""
    router = re.search(r"router (\S+?)[;\s]", ready).group(1)  # type: ignore[union-attr]
    async with grpc.aio.insecure_channel(router) as channel:
        outcome = await generate(channel, PROMPTS[0], greedy(MAX_NEW_TOKENS))
    assert outcome.code is grpc.StatusCode.OK, outcome.ending
    async with grpc.aio.insecure_channel(worker) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        for _ in range(50):
            info = wire.worker_info_from_proto(
                await stub.Info(worker_pb2.InfoRequest(), metadata=METADATA, timeout=5)
            )
            if info.num_free_blocks == info.num_total_blocks and not info.num_running_requests:
                break
            await asyncio.sleep(0.1)
    assert info.role is WorkerRole.COLOCATED
    assert info.num_free_blocks == info.num_total_blocks and not info.num_leases, info
    assert not info.num_running_requests, info
    return outcome.token_ids


def stop(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache")


def test_layout_colocated_serves_the_single_engine_tokens(model_dir: Path, tmp_path) -> None:
    process = up(model_dir, tmp_path / "logs", "--layout", "colocated")
    try:
        plan, ready = started(process, tmp_path / "logs")
        # on CPU there is no card to plan; on a GPU the colocated worker's plan is checked
        assert plan.startswith(("layout: colocated — no card to plan",
                                "layout: colocated — as asked: one worker")), plan  # fmt: skip
        workers = pools(ready)
        assert workers["prefill"] == [] and len(workers["decode"]) == 1, ready
        tokens = asyncio.run(serve_and_check(ready, workers["decode"][0]))
        assert tokens == single_engine_outputs(model_dir, PROMPTS[:1], MAX_NEW_TOKENS)[0]
    finally:
        stop(process)


def test_auto_picks_colocated_when_two_copies_do_not_fit(model_dir: Path, tmp_path) -> None:
    card = card_gib_for_one_copy(model_dir)
    process = up(model_dir, tmp_path / "logs", *CPU, "--device-memory-gib", f"{card:.6f}")
    try:
        plan, ready = started(process, tmp_path / "logs")
        assert plan.startswith("layout: colocated — 2 copies of the weights (2 x "), plan
        assert "one worker at --memory-fraction 0.9" in plan, plan
        workers = pools(ready)
        assert workers["prefill"] == [] and len(workers["decode"]) == 1, ready
        assert len(asyncio.run(serve_and_check(ready, workers["decode"][0]))) == MAX_NEW_TOKENS
    finally:
        stop(process)
