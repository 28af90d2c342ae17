"""Engine test helpers: a random tiny model shared per module, and a run-to-completion loop."""

from __future__ import annotations

import pytest
import torch

from dsv4.cache.packing import CacheOptions
from dsv4.config.model import tiny_config
from dsv4.engine.core import EngineCore, EngineOptions, build_engine_core
from dsv4.model.tiny import random_model
from dsv4.runner.paged import PagedOptions
from dsv4.runner.paged.decode_graphs import GraphOptions
from dsv4.runner.reference import ReferenceOptions
from dsv4.scheduler.config import SchedulerConfig
from dsv4.scheduler.request import Request
from kernels.backend import KernelBackendConfig

# The CPU paths that choose a step's tokens, each a `make_core` keyword set: the reference
# forward, the paged forward eagerly, its static decode passes (`capture=False`: the captured
# graphs' code) and those with their in-graph argmax (`features.greedy_in_graph`), which must
# leave to the sampler every row whose logits it needs (`needs_logits_processing`).
_PASSES = {"max_batch": 4, "max_model_len": 2048, "capture": False}
TOKEN_PATHS = {
    "reference": {},
    "paged": {"paged": {}},
    "paged-graphs": {"paged": {}, "graphs": GraphOptions(**_PASSES)},
    "paged-greedy-in-graph": {"paged": {}, "graphs": GraphOptions(**_PASSES, greedy_argmax=True)},
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny():
    return random_model(tiny_config().with_overrides(num_nextn_predict_layers=0), seed=3)


def make_core(
    model, *, kv="fp32", index="fp32", budget=4096, num_blocks=64, shared_metadata=None,
    paged=None, kernels=None, index_pattern="", graphs=None, spec_tokens=0,
    batched_sampling=True, routing_stats=False, async_scheduling=False, stop_checker=None,
    **sched,
) -> EngineCore:  # fmt: skip
    """`paged`: None = the reference forward, else the paged forward's `PagedOptions` fields
    (a dict); `graphs`: a `GraphOptions` (static decode passes of the paged forward: graphs
    are `PagedOptions.graphs`); `spec_tokens`: MTP drafts k."""
    options = CacheOptions(block_size=128, kv_dtype=kv, index_dtype=index,
                           index_pattern=index_pattern, num_speculative_tokens=spec_tokens)  # fmt: skip
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=sched.pop("max_num_seqs", 16),
        max_model_len=2048, num_speculative_tokens=spec_tokens, **sched,
    )  # fmt: skip
    if graphs is not None and paged is None:
        raise ValueError("graphs capture the paged forward: pass paged={} too")
    kernels = kernels or KernelBackendConfig()
    return build_engine_core(model, EngineOptions(
        options, cfg, num_blocks, device=str(model.embed.weight.device), kernels=kernels,
        paged=None if paged is None else PagedOptions(**paged, graphs=graphs),
        reference=ReferenceOptions(shared_slot_tables=shared_metadata, kernels=kernels),
        batched_sampling=batched_sampling, routing_stats=routing_stats,
        async_scheduling=async_scheduling,
    ), stop_checker)  # fmt: skip


def run_to_completion(core: EngineCore, max_steps: int = 2000) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not core.has_work():
            return outputs
        for out in core.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def greedy_request(rid: str, prompt: list[int], n: int) -> Request:
    return Request(rid, tuple(prompt), max_new_tokens=n, eos_token_id=None)
