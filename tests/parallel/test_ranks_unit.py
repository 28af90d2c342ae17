"""The pieces of a worker of several ranks, in one process: the step pipe's framing, the
config refusals, rank devices, the per-rank start-up plan, rank 0's core noting pulled KV
blocks for the followers, and tensor-parallel experts at world size 1 (exact)."""

from __future__ import annotations

import io

import pytest
import torch

from dsv4.cache.packing import CacheOptions
from dsv4.config import load_config, resolve_auto
from dsv4.config.model import tiny_config
from dsv4.engine.core import EngineOptions, build_engine_core
from dsv4.errors import ConfigError
from dsv4.model.tiny import random_model
from dsv4.parallel import ParallelGroup, shard_model
from dsv4.parallel.ranks import (
    RankedEngineCore,
    RankGroup,
    check_rank_config,
    rank_config,
    rank_device,
)
from dsv4.parallel.step_broadcast import StepMessage, StopMessage, read_message, write_message
from dsv4.plan import PlanDoesNotFit, full_flash_config
from dsv4.scheduler.batch import ScheduledBatch, ScheduledRequest
from dsv4.scheduler.config import SchedulerConfig
from dsv4.scheduler.request import Request
from dsv4.worker.build import start_ranks
from dsv4.worker.fit import GIB, startup_plan
from tests.leak import assert_no_leaks
from tests.parallel.tp_worker import SEED, run_workload


def test_messages_round_trip_and_a_closed_or_cut_pipe_reads_as_none() -> None:
    request = ScheduledRequest("r1", (5, 6, 7), 0, True, 0, True, (3,), (4, 5))
    step = StepMessage(ScheduledBatch((request,), finished_request_ids=("r0",)), (3, 4, 5))
    stream = io.BytesIO()
    write_message(stream, step)
    write_message(stream, StopMessage("done"))
    whole = stream.getvalue()
    stream.seek(0)
    assert read_message(stream) == step
    assert read_message(stream) == StopMessage("done")
    assert read_message(stream) is None  # EOF: rank 0 is gone
    cut = io.BytesIO(whole[:-3])  # the writer died inside the second message
    assert read_message(cut) == step
    assert read_message(cut) is None


def served(overrides: dict, has_cuda: bool = False):
    return resolve_auto(load_config(overrides, None, {}), has_cuda=has_cuda, hostname="h", pid=1)


def test_several_ranks_refuse_what_is_not_sharded_yet() -> None:
    assert served({"model.tensor_parallel_size": 2}, has_cuda=True).features.forward == "paged"
    assert served({"model.tensor_parallel_size": 2}).features.forward == "reference"  # CPU
    assert served({}, has_cuda=True).features.forward == "paged"
    cases = [
        ({"speculative.method": "mtp"}, "speculative.method"),
        ({"model.distributed_backend": "nccl"}, "model.distributed_backend"),
    ]
    for overrides, field in cases:
        with pytest.raises(ConfigError) as failure:
            check_rank_config(served({"model.tensor_parallel_size": 2, **overrides}))
        assert failure.value.field_name == field
    check_rank_config(served({"model.tensor_parallel_size": 2}))  # CPU + reference: fine
    check_rank_config(served({"model.tensor_parallel_size": 2, "features.forward": "paged"}))


def test_a_world_size_the_model_cannot_split_is_refused_before_any_rank_starts() -> None:
    # the tiny model has 2 output groups: 3 ranks cannot each own whole groups
    with pytest.raises(ConfigError, match="o_groups"):
        start_ranks(served({"model.tensor_parallel_size": 3}))


def test_rank_devices() -> None:
    assert rank_device("cpu", 3) == "cpu"
    count = max(1, torch.cuda.device_count())
    assert rank_device("cuda", 1) == f"cuda:{1 % count}"
    config = served({"model.tensor_parallel_size": 2})
    assert rank_config(config, 1) == config  # on CPU every rank's config is rank 0's


def test_start_up_plan_is_the_per_gpu_plan_of_the_rank_count() -> None:
    def plan(ranks: int, ep: bool):
        config = load_config({"model.max_model_len": 8192, "model.tensor_parallel_size": ranks,
                              "model.expert_parallel": ep}, None, {})  # fmt: skip
        return startup_plan(config, full_flash_config(), 141 * GIB)

    with pytest.raises(PlanDoesNotFit, match=r"tp=1, ep=1"):  # bf16 experts: ~516 GiB
        plan(1, False)
    tp8, ep8 = plan(8, False), plan(8, True)  # raise if they did not fit
    assert (tp8.request.tp, tp8.request.ep, ep8.request.tp, ep8.request.ep) == (8, 1, 8, 8)
    assert ep8.routed_expert_bytes < 70 * GIB and tp8.routed_expert_bytes < 70 * GIB


def test_rank_zero_core_hands_pulled_blocks_to_the_next_step() -> None:
    model = random_model(tiny_config(), SEED)
    options = CacheOptions(block_size=128, kv_dtype="fp32", index_dtype="fp32")
    sched = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=4, max_model_len=1024)
    ranks = RankGroup(ParallelGroup.single())  # no followers: sending is a no-op
    core = RankedEngineCore(build_engine_core(model, EngineOptions(options, sched, 16)), ranks)
    pulled = Request("pulled", tuple(range(2, 40)), max_new_tokens=3, eos_token_id=None)
    pulled.output_token_ids.append(7)  # the first token, sampled by the prefill worker
    block_ids = core.adopt(pulled)
    assert core.runner.pulled_block_ids == []  # not landed yet: nothing to copy
    core.activate("pulled")
    assert core.runner.pulled_block_ids == list(block_ids)
    while core.has_work():
        core.step()
    assert core.runner.pulled_block_ids == []  # sent with the first step, once
    gone = Request("gone", tuple(range(2, 20)), max_new_tokens=2, eos_token_id=None)
    gone.output_token_ids.append(7)
    core.adopt(gone)
    core.abandon("gone")  # a failed pull: nothing to copy
    assert core.runner.pulled_block_ids == [] and not core._adopted_blocks
    assert_no_leaks(core)
    ranks.close()


@torch.no_grad()
def test_tensor_parallel_experts_at_world_size_one_equal_unsharded_exactly() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = run_workload(random_model(tiny_config(), SEED))
        model = shard_model(random_model(tiny_config(), SEED), ParallelGroup.single(),
                            expert_parallel=False)  # fmt: skip
        sharded = run_workload(model)
    finally:
        torch.set_num_threads(threads)
    assert sharded.generated == reference.generated
    assert torch.equal(sharded.cached_logits, reference.cached_logits)


def test_expert_parallel_pairs_on_local_slots_sum_to_the_one_rank_experts() -> None:
    """`local_expert_pairs`: each rank's grouped GEMM on its own experts (others' pairs
    id -1, weight 0, skipped) gives its share; the shares sum to the one-rank output."""
    from dsv4.parallel.moe import local_expert_pairs
    from kernels.moe import moe_experts_ref

    gen = torch.Generator().manual_seed(0)
    num_experts, world, dim, inter = 5, 2, 16, 8  # 5 experts: rank 0 holds 3, rank 1 holds 2
    w13 = torch.randn(num_experts, 2 * inter, dim, generator=gen)
    w2 = torch.randn(num_experts, dim, inter, generator=gen)
    x = torch.randn(7, dim, generator=gen)
    ids = torch.randint(0, num_experts, (7, 3), generator=gen)
    weights = torch.rand(7, 3, generator=gen)
    whole = moe_experts_ref(x, ids, weights, w13, w2)
    total = torch.zeros_like(whole)
    for rank in range(world):
        held = list(range(rank, num_experts, world))
        w, slots = local_expert_pairs(weights, ids, ParallelGroup(rank, world))
        assert int(slots.max()) < len(held)
        assert torch.equal(w != 0, ids % world == rank) and torch.equal(slots < 0, w == 0)
        total += moe_experts_ref(x, slots, w, w13[held], w2[held], skip=True)
    torch.testing.assert_close(total, whole, atol=1e-5, rtol=1e-5)
