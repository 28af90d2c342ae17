"""Tensor + expert parallelism over 2 gloo ranks equals the single-process model.

Two rank processes (`tests/parallel/tp_worker.py`) shard the same deterministic tiny model and
run a full forward (prompt lengths 1, 7, 130) plus the MTP draft on its streams, a chunked
prefill + token-by-token decode of two rows, and greedy generation; the parent runs the same
workload unsharded.

Tolerance: logits within 1e-4 absolute (fp32, logits of order 5). Sharding changes only the
order of fp32 sums: each rank sums its heads' share of the output projection and its experts'
outputs, then the all-reduce adds the two partials (in fp32). Those reorderings cost ~1e-7
relative per sum; measured max |diff| is ~4e-6 after 4 blocks, so 1e-4 leaves a 25x margin
while still catching any wrong head, group or expert slice (those move logits by O(1)).
World size 1 must match exactly.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dsv4.config.model import tiny_config
from dsv4.errors import ConfigError
from dsv4.model.tiny import random_model
from dsv4.parallel import ParallelGroup, check_shardable, launch_env, shard_model
from dsv4.serving.ports import free_port
from tests.parallel.tp_worker import SEED, RankReport, Workload, run_workload

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
WORLD = 2
ATOL = 1e-4
RANKS_TIMEOUT_S = 120.0  # both ranks, start-up included; the group timeout inside is 60 s


def start_ranks(out: Path) -> list[subprocess.Popen]:
    env = launch_env()
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    port = free_port()
    procs = []
    for rank in range(WORLD):
        cmd = [sys.executable, "-m", "tests.parallel.tp_worker", "--rank", str(rank)]
        cmd += ["--world-size", str(WORLD), "--port", str(port), "--out", str(out / f"{rank}.pt")]
        with open(out / f"{rank}.log", "wb") as log:
            procs.append(
                subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            )
    return procs


def wait_ranks(procs: list[subprocess.Popen], out: Path) -> None:
    """Wait for every rank (bounded); a failed or hung rank fails the test with its log."""
    deadline = time.monotonic() + RANKS_TIMEOUT_S
    try:
        for rank, proc in enumerate(procs):
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
            if code != 0:
                log = (out / f"{rank}.log").read_text(errors="replace")[-3000:]
                pytest.fail(f"rank {rank} {'hung' if code is None else f'exit {code}'}:\n{log}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Workload, list[RankReport]]:
    """(the unsharded workload, one report per rank); the parent computes its reference while
    the ranks run."""
    out = tmp_path_factory.mktemp("tp")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    procs = start_ranks(out)
    try:
        reference = run_workload(random_model(tiny_config(), SEED))
    finally:
        torch.set_num_threads(threads)
        wait_ranks(procs, out)
    reports = [torch.load(out / f"{r}.pt", weights_only=False) for r in range(WORLD)]
    return reference, reports


def test_full_forward_matches_single_process(runs):
    reference, reports = runs
    sharded = reports[0].workload
    for ref, got in zip(reference.forward_logits, sharded.forward_logits, strict=True):
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(sharded.mtp_logits, reference.mtp_logits, atol=ATOL, rtol=0)


def test_chunked_prefill_and_decode_match_single_process(runs):
    reference, reports = runs
    got = reports[0].workload.cached_logits  # [2, 140, V]
    torch.testing.assert_close(got, reference.cached_logits, atol=ATOL, rtol=0)


def test_greedy_tokens_identical(runs):
    reference, reports = runs
    assert reports[0].workload.generated == reference.generated
    assert all(len(tokens) == 16 for tokens in reference.generated)


def test_each_rank_holds_only_its_experts(runs):
    _, reports = runs
    cfg = tiny_config()
    full = random_model(cfg, SEED)
    full_expert_params = sum(p.numel() for n, p in full.named_parameters() if ".ffn.experts." in n)
    full_params = sum(p.numel() for p in full.parameters())
    layers = {f"layers.{i}" for i in range(cfg.num_hidden_layers)} | {"mtp.0"}
    for report in reports:
        mine = tuple(range(report.rank, cfg.n_routed_experts, WORLD))
        assert report.expert_ids == dict.fromkeys(layers, mine)
        assert report.num_expert_params * WORLD == full_expert_params
        assert report.num_params < full_params - full_expert_params // WORLD


@torch.no_grad()
def test_world_size_one_equals_unsharded_exactly():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = run_workload(random_model(tiny_config(), SEED))
        sharded = run_workload(
            shard_model(random_model(tiny_config(), SEED), ParallelGroup.single())
        )
    finally:
        torch.set_num_threads(threads)
    for ref, got in zip(reference.forward_logits, sharded.forward_logits, strict=True):
        assert torch.equal(got, ref)
    assert torch.equal(sharded.cached_logits, reference.cached_logits)
    assert sharded.generated == reference.generated
    assert torch.equal(sharded.mtp_logits, reference.mtp_logits)


def test_bad_world_sizes_raise_config_errors():
    with pytest.raises(ConfigError) as err:
        check_shardable(tiny_config(), 3)  # o_groups = 2
    assert err.value.field_name == "o_groups"
    model = random_model(tiny_config(), SEED)
    with pytest.raises(ConfigError) as err:
        shard_model(model, ParallelGroup(rank=0, world_size=4))
    assert err.value.field_name == "o_groups"
    shard_model(model, ParallelGroup.single())  # the failed call above changed nothing
    with pytest.raises(ConfigError) as err:
        shard_model(model, ParallelGroup.single())
    assert err.value.field_name == "model"
    with pytest.raises(ConfigError) as err:
        ParallelGroup(rank=2, world_size=2)
    assert err.value.field_name == "rank"
