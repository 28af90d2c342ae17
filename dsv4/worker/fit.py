"""Start-up memory check: the worker computes `dsv4 plan`'s plan before loading any weight and
refuses to start with the plan's message when the model, KV cache and workspaces cannot fit,
instead of running out of memory halfway through the load (issue 11). With a host budget
(`model.host_memory_gib`) the plan may offload routed experts (`dsv4.worker.offload`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from dsv4.cache.packing import CacheOptions
from dsv4.config import ServeConfig
from dsv4.config.model import ModelConfig
from dsv4.plan import (
    FITS,
    MemoryPlan,
    PlanDoesNotFit,
    PlanRequest,
    WeightFormats,
    check_fits,
    plan_memory,
)

GIB = 1 << 30
logger = logging.getLogger(__name__)
# `dsv4 plan`'s change to the worker's request (its GPU count, TP/EP, nodes, KV for N requests)
RequestEdit = Callable[[PlanRequest], PlanRequest]


def planned_model_config(config: ServeConfig) -> ModelConfig:
    """The model's config, read before any weight is loaded."""
    if config.model.path == "tiny":
        from dsv4.config.model import tiny_config

        return tiny_config()
    return ModelConfig.from_file(config.model.model_dir)


def max_decode_tokens(config: ServeConfig) -> int:
    """The largest captured decode step's tokens: the graphs' max batch x (1 + MTP draft
    tokens). Larger decode steps run eagerly, where the expert pool may fetch in rounds."""
    s = config.speculative
    batch = min(config.scheduler.max_num_seqs, config.features.cuda_graph_max_batch)
    return batch * (1 + (s.num_speculative_tokens if s.method == "mtp" else 0))


def startup_plan(
    config: ServeConfig,
    model_cfg: ModelConfig,
    gpu_total_bytes: int,
    edit: RequestEdit | None = None,
) -> MemoryPlan:
    """The plan for one GPU of `gpu_total_bytes` of a worker of `model.tensor_parallel_size`
    ranks (`dsv4 plan --gpus T --tp T --ep T|1`'s per-GPU plan); raises `PlanDoesNotFit`.

    The model holds the FP8 linears as `features.linear_weights` says (bf16, or the
    checkpoint's FP8 with block scales) and the routed experts as `features.expert_weights`
    says (bf16, or the checkpoint's MXFP4 / FP8). `model.host_memory_gib` is the pinned host
    budget for offloaded experts (all of it may be pinned: 0 plans without offload); on a CPU
    device (`model.device_memory_gib` set) no CUDA runtime reserve is held back. KV is sized
    for one maximum-length request: the worker sizes the rest from what remains.

    When offloading would fit the device but not the host budget, the refusal is one line
    with the shortfall; otherwise it is the plan's message. `edit` (`dsv4 plan`) changes the
    request before it is planned. Weight formats "auto" are resolved first
    (`resolve_weight_formats`; a resolved config is planned as it is)."""
    config = resolve_weight_formats(config, model_cfg, gpu_total_bytes, edit)
    plan = plan_memory(startup_request(config, model_cfg, gpu_total_bytes, edit))
    host_gib = config.model.host_memory_gib
    if not plan.fits and plan.offloaded_per_layer and plan.needed_bytes <= plan.usable_bytes:
        if host_gib:  # offload fits the device: the host budget alone is short
            raise PlanDoesNotFit(host_shortfall(plan, host_gib))
        raise PlanDoesNotFit(f"{plan.message} With expert offload it {host_shortfall(plan, 0)}.")
    return check_fits(plan)


def device_plan(
    config: ServeConfig, model_cfg: ModelConfig, total: int, edit: RequestEdit | None = None
) -> tuple[ServeConfig, MemoryPlan]:
    """(config, plan) of a worker on a device of `total` bytes, as its start-up takes them:
    with offload on the paged forward the captured decode batch first shrinks until the plan
    fits (`fit_graph_batch`). Raises `PlanDoesNotFit` in one line."""
    config = startup_config(config, model_cfg, total, edit)
    return config, startup_plan(config, model_cfg, total, edit)


def startup_config(
    config: ServeConfig, model_cfg: ModelConfig, total: int, edit: RequestEdit | None = None
) -> ServeConfig:
    """`config` as start-up plans it: weight formats "auto" resolved (`resolve_weight_formats`),
    then with offload on the paged forward, the captured decode batch shrunk until the plan
    fits (`fit_graph_batch`; batch 1 when none does)."""
    config = resolve_weight_formats(config, model_cfg, total, edit)
    if config.features.forward == "paged" and config.model.host_memory_gib:
        return fit_graph_batch(config, model_cfg, total, edit)
    return config


AUTO = "auto"
EXPERT_FORMATS = {"fp4": "MXFP4", "fp8": "FP8"}  # ModelConfig.expert_dtype -> as served
SERVED_FP8_BLOCK = 128  # FP8 linears are served with 128x128 scale blocks (dsv4.model.fp8)


def resolve_weight_formats(
    config: ServeConfig, model_cfg: ModelConfig, total: int, edit: RequestEdit | None = None
) -> ServeConfig:
    """`features.expert_weights` / `linear_weights` "auto" resolved, the one place that does
    (issues 21, 22): the checkpoint's formats on a GPU, since they serve faster end to end than
    bf16 (4-layer V4-Flash slice on an H100: TPOT 1.24x at batch 1, 1.54x at 64 streams, TTFT
    of a 1024-token prompt 1.00x; docs/BENCHMARKS.md, session 19) in a quarter / half of the
    bytes: experts where the model stores them as MXFP4 / FP8, linears where it stores FP8 (a
    model storing bf16 ones: bf16). Linears auto with `linear_activations` fp8: checkpoint.
    bf16 with no plan (`total` 0: a CPU device without a device budget) and for several
    tensor-parallel ranks, the config's or the plan edit's (tensor parallelism shards bf16
    weights only); on a CPU device with a budget (the formats run their dequantising
    references there) bf16 where the bf16 plan fits without offload. A shared-expert fuse that the
    resolved formats forbid is turned off with a warning. Logs what auto chose and why."""
    f = config.features
    if AUTO not in (f.expert_weights, f.linear_weights):
        return config
    fp8_activations = f.linear_activations == "fp8"
    if not total:
        as_stored, why = False, "no device plan"
    elif _tensor_parallel(config, model_cfg, total, edit):
        as_stored, why = False, "tensor parallelism shards bf16 weights only"
    elif config.model.device.startswith("cuda"):
        as_stored, why = True, "faster end to end than bf16 (docs/BENCHMARKS.md)"
    else:  # a CPU device runs the formats' dequantising references: bf16 where it fits
        as_stored, why = _bf16_short(config, model_cfg, total, edit)
    experts, linears = f.expert_weights, f.linear_weights
    if experts == AUTO:
        experts = "checkpoint" if as_stored and model_cfg.expert_dtype in EXPERT_FORMATS else "bf16"
    if linears == AUTO:
        fp8 = model_cfg.linear_dtype == "fp8" and model_cfg.fp8_block_size == SERVED_FP8_BLOCK
        linears = "checkpoint" if fp8_activations or (as_stored and fp8) else "bf16"
    quantized = (experts == "checkpoint" and model_cfg.expert_dtype in EXPERT_FORMATS,
                 linears == "checkpoint" and model_cfg.linear_dtype == "fp8")  # fmt: skip
    held = (f"{EXPERT_FORMATS[model_cfg.expert_dtype] if quantized[0] else 'bf16'} experts, "
            f"{'FP8' if quantized[1] else 'bf16'} linears")  # fmt: skip
    chose = f"checkpoint formats ({held})" if any(quantized) else "bf16"
    stores = model_cfg.expert_dtype in EXPERT_FORMATS or model_cfg.linear_dtype == "fp8"
    forced = "; linear_activations fp8 holds the linears as stored" if (
        fp8_activations and f.linear_weights == AUTO) else ""  # fmt: skip
    level = logging.INFO if stores else logging.DEBUG  # a bf16 checkpoint leaves no choice
    logger.log(level, "weights auto: %s: %s%s", chose, why, forced)
    fuse = f.fuse_shared_expert
    if fuse and any(quantized):
        logger.warning("fuse_shared_expert off: the grouped GEMM takes one format per launch "
                       "and auto weights resolved to %s", held)  # fmt: skip
        fuse = False
    return dataclasses.replace(config, features=dataclasses.replace(
        f, expert_weights=experts, linear_weights=linears, fuse_shared_expert=fuse))  # fmt: skip


def _tensor_parallel(
    config: ServeConfig, model_cfg: ModelConfig, total: int, edit: RequestEdit | None
) -> bool:
    """Whether the worker (its config, or `dsv4 plan`'s edit of its request) shards its weights
    over several tensor-parallel ranks."""
    if config.model.tensor_parallel_size > 1:
        return True
    # the request takes resolved formats; its ranks do not depend on which
    request = startup_request(_auto_as_bf16(config), model_cfg, total, edit)
    return (request.tp or request.num_gpus) > 1


def _auto_as_bf16(config: ServeConfig) -> ServeConfig:
    """`config` with its "auto" weight formats as bf16 (linears as stored under
    `linear_activations` fp8, which holds them so whatever auto decides)."""
    f = config.features
    linears = "checkpoint" if f.linear_activations == "fp8" else "bf16"
    return dataclasses.replace(config, features=dataclasses.replace(
        f, expert_weights="bf16" if f.expert_weights == AUTO else f.expert_weights,
        linear_weights=linears if f.linear_weights == AUTO else f.linear_weights))  # fmt: skip


def _bf16_short(
    config: ServeConfig, model_cfg: ModelConfig, total: int, edit: RequestEdit | None
) -> tuple[bool, str]:
    """(whether the worker's plan with its auto formats as bf16 falls short of the device
    without offload, the numbers that say so)."""
    as_bf16 = _auto_as_bf16(config)
    trial = dataclasses.replace(  # without offload
        as_bf16, model=dataclasses.replace(as_bf16.model, host_memory_gib=0.0)
    )
    try:
        plan = plan_memory(startup_request(trial, model_cfg, total, edit))
    except PlanDoesNotFit as exc:
        return True, f"bf16: {exc.message}"
    usage = f"{size_text(plan.needed_bytes)} of {size_text(plan.usable_bytes)} usable"
    if plan.verdict == FITS:
        return False, f"bf16 fits without offload ({usage})"
    return True, f"bf16 needs {usage}"


def fit_graph_batch(
    config: ServeConfig, model_cfg: ModelConfig, total: int, edit: RequestEdit | None = None
) -> ServeConfig:
    """The paged forward's expert pool holds a captured decode step's misses in its slots
    (`max_decode_tokens` x top-k a layer), which the plan counts: halve the captured batch
    (`features.cuda_graph_max_batch`) until the plan fits. Larger decode steps run eagerly,
    fetching in rounds; a plan that fits at no batch is left to refuse as it does."""
    f = config.features
    batch = min(config.scheduler.max_num_seqs, f.cuda_graph_max_batch)
    while batch > 1:
        trial = dataclasses.replace(config, features=dataclasses.replace(
            f, cuda_graph_max_batch=batch))  # fmt: skip
        try:
            plan = startup_plan(trial, model_cfg, total, edit)
        except PlanDoesNotFit:
            batch //= 2
            continue
        if batch < min(config.scheduler.max_num_seqs, f.cuda_graph_max_batch):
            logger.info("expert offload: decode graphs up to batch %d (the pool's slots hold "
                        "a captured step's misses; larger batches run eagerly)", batch)  # fmt: skip
        _log_residency_cost(trial, plan, model_cfg, total, batch, edit)
        return trial
    return dataclasses.replace(config, features=dataclasses.replace(f, cuda_graph_max_batch=1))


def _log_residency_cost(config: ServeConfig, at_batch: MemoryPlan, model_cfg: ModelConfig,
                        total: int, batch: int, edit: RequestEdit | None) -> None:  # fmt: skip
    """The slots of a captured batch of `batch` (`at_batch`: its plan) come out of the resident
    experts: say how many a layer stay resident at this batch and at batch 1, so an operator
    sees what the captured batch costs a batch-1 step (`--max-num-seqs`; docs/operations.md)."""
    if not at_batch.offloaded_per_layer:
        return
    f = config.features
    one = dataclasses.replace(config, features=dataclasses.replace(f, cuda_graph_max_batch=1))
    try:
        at_one = startup_plan(one, model_cfg, total, edit)
    except PlanDoesNotFit:
        return
    resident = [p.experts_per_layer - p.offloaded_per_layer for p in (at_batch, at_one)]
    if resident[0] < resident[1]:
        logger.info("expert offload: %d of %d experts a layer resident with decode graphs up to "
                    "batch %d (%d slots), %d with --max-num-seqs 1", resident[0],
                    at_batch.experts_per_layer, batch, at_batch.cache_slots, resident[1])  # fmt: skip


def host_shortfall(plan: MemoryPlan, host_memory_gib: float) -> str:
    """The refusal of a plan whose offload fits the device but not the pinned host budget."""
    idle = " + the unused MTP layer's" if plan.idle_moe_layers else ""
    return (
        f"needs {size_text(plan.host_bytes)} of pinned host memory for"
        f" {plan.offloaded_per_layer} of {plan.experts_per_layer} experts x"
        f" {plan.num_moe_layers} layers{idle}; --host-memory-gib gives {host_memory_gib:g}"
    )


def size_text(nbytes: int) -> str:
    """GiB with one decimal (MiB below 0.1 GiB, where one decimal of GiB says nothing)."""
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB // 10 else f"{nbytes / (1 << 20):.1f} MiB"


def startup_request(
    config: ServeConfig,
    model_cfg: ModelConfig,
    gpu_total_bytes: int,
    edit: RequestEdit | None = None,
) -> PlanRequest:
    """`startup_plan`'s request (after `edit`): its plan's numbers even where the plan does not
    fit."""
    request = _worker_request(config, model_cfg, gpu_total_bytes)
    return edit(request) if edit is not None else request


def _worker_request(
    config: ServeConfig, model_cfg: ModelConfig, gpu_total_bytes: int
) -> PlanRequest:
    """The request of the worker's own start-up (no `edit`)."""
    if AUTO in (config.features.expert_weights, config.features.linear_weights):
        raise ValueError("weight formats auto: resolve them first (startup_config)")
    spec = config.speculative
    ranks = config.model.tensor_parallel_size  # one GPU per rank: the plan of one of them
    on_cuda = config.model.device.startswith("cuda")
    return PlanRequest(
        model=model_cfg,
        num_gpus=ranks,
        gpus_per_node=ranks,
        tp=ranks,
        ep=ranks if config.model.expert_parallel else 1,
        gpu_mem_gib=gpu_total_bytes / GIB,
        host_mem_gib=config.model.host_memory_gib,
        host_mem_fraction=1.0,  # the flag is the pinned budget itself
        runtime_reserve_gib=1.0 if on_cuda else 0.0,
        max_model_len=config.model.max_model_len or model_cfg.max_position_embeddings,
        max_num_seqs=1,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        num_speculative_tokens=spec.num_speculative_tokens if spec.method == "mtp" else 0,
        cuda_graphs=config.features.cuda_graphs
        and config.features.forward == "paged"
        and on_cuda,  # as `graph_options` decides
        memory_fraction=config.cache.memory_fraction,
        # the paged forward's expert pool fetches a decode step's misses in one round: its
        # slots hold every expert such a step can miss (`dsv4.runner.paged.expert_pool`)
        cache_slots=max_decode_tokens(config) * model_cfg.num_experts_per_tok
        if config.features.forward == "paged"
        else 0,
        staging_experts=config.features.expert_staging if config.features.forward == "paged" else 0,
        idle_layer_slots=config.features.forward != "paged",  # as `apply_offload` builds stores
        formats=WeightFormats(config.features.linear_weights, config.features.expert_weights),
        cache=CacheOptions(
            block_size=config.cache.block_size,
            kv_dtype="fp8" if config.cache.kv_dtype == "auto" else config.cache.kv_dtype,
            index_dtype=config.cache.indexer_key_dtype,
        ),
    )
