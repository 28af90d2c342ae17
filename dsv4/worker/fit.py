"""Start-up memory check: the worker computes `dsv4 plan`'s plan before loading any weight and
refuses to start with the plan's message when the model, KV cache and workspaces cannot fit,
instead of running out of memory halfway through the load (issue 11)."""

from __future__ import annotations

from dsv4.cache.packing import CacheOptions
from dsv4.config import ServeConfig
from dsv4.config.model import ModelConfig
from dsv4.plan import MemoryPlan, PlanRequest, WeightFormats, check_fits, plan_memory

GIB = 1 << 30


def startup_plan(config: ServeConfig, model_cfg: ModelConfig, gpu_total_bytes: int) -> MemoryPlan:
    """The plan for one GPU of `gpu_total_bytes` of a worker of `model.tensor_parallel_size`
    ranks (`dsv4 plan --gpus T --tp T --ep T|1`'s per-GPU plan); raises `PlanDoesNotFit`.

    The model holds the FP8 linears as `features.linear_weights` says (bf16, or the
    checkpoint's FP8 with block scales) and the routed experts as `features.expert_weights`
    says (bf16, or the checkpoint's MXFP4 / FP8), and workers keep
    experts on the GPU (no host offload), so those are the formats and the host budget planned
    for. KV is sized for one maximum-length request: the worker sizes the rest from what
    remains."""
    spec = config.speculative
    ranks = config.model.tensor_parallel_size  # one GPU per rank: the plan of one of them
    request = PlanRequest(
        model=model_cfg,
        num_gpus=ranks,
        gpus_per_node=ranks,
        tp=ranks,
        ep=ranks if config.model.expert_parallel else 1,
        gpu_mem_gib=gpu_total_bytes / GIB,
        host_mem_gib=0.0,
        max_model_len=config.model.max_model_len or model_cfg.max_position_embeddings,
        max_num_seqs=1,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        num_speculative_tokens=spec.num_speculative_tokens if spec.method == "mtp" else 0,
        cuda_graphs=config.features.cuda_graphs and config.features.forward == "paged",
        memory_fraction=config.cache.memory_fraction,
        formats=WeightFormats(config.features.linear_weights, config.features.expert_weights),
        cache=CacheOptions(
            block_size=config.cache.block_size,
            kv_dtype="fp8" if config.cache.kv_dtype == "auto" else config.cache.kv_dtype,
            index_dtype=config.cache.indexer_key_dtype,
        ),
    )
    return check_fits(plan_memory(request))
