"""ServeConfig -> the parts of one model replica: model, engine, KV transport and layout.

`build_worker_runtime` is the one construction path used by the prefill and decode workers (and
by tests that want the single-engine baseline with exactly the workers' cache layout). It runs
once per process, at start-up, on the main thread; failures raise `CheckpointError` (bad model
path), `ConfigError` (bad cache options) or `TransferError` (the transport cannot register).

Decisions:
- `model.path == "random:DIR"` reads DIR's config.json and draws random weights from
  `model.seed` on the device (the same in every process: P and D serve one model);
- `model.path == "tiny"` builds the deterministic random tiny model in memory (no I/O; seed
  `model.seed`) with the deterministic tiny tokenizer; `dsv4 up` writes a real checkpoint
  instead, so every process of a cluster loads the same bytes.
- kv_dtype "auto" is resolved by `dsv4.config.resolve_auto`: fp8 on GPU for the production
  head_dim, bf16 otherwise (CPU). Quantised caches are deterministic, so the disaggregated
  output still equals a single engine built here with the same config; only comparisons with
  the uncached reference model need `--kv-dtype` of the model's own precision.
- num_blocks 0 derives from `cache.memory_budget_bytes`; on CPU without a budget a modest
  `dsv4.worker.kv_budget.CPU_DEFAULT_KV_BUDGET_BYTES` is used (the host RAM fraction would be
  far too much); the option objects come from `dsv4.worker.options`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from dataclasses import dataclass

import torch

from dsv4.cache.layout import KVLayout
from dsv4.config import ServeConfig, request_limits, resolve_auto
from dsv4.config.model import ModelConfig
from dsv4.engine.async_engine import AsyncEngine
from dsv4.engine.core import EngineOptions, build_engine_core
from dsv4.errors import CheckpointError, ConfigError, DeviceOutOfMemory
from dsv4.model.fp8 import set_linear_activations_
from dsv4.model.offload_load import ExpertOffload
from dsv4.runner.paged.collectives import ONE_RANK
from dsv4.scheduler.config import SchedulerConfig
from dsv4.scheduler.request import Request
from dsv4.text.tokenizer import TextCodec
from dsv4.transfer import KVTransport, make_transport
from dsv4.types import GenerateRequest, KVLayoutInfo, RequestLimits
from dsv4.worker.fit import AUTO, max_decode_tokens, planned_model_config, resolve_weight_formats
from dsv4.worker.kv_budget import num_blocks_for
from dsv4.worker.offload import WorkerOffload, apply_offload, startup_offload
from dsv4.worker.options import (
    apply_features,
    cache_options,
    engine_async_scheduling,
    kernel_config,
    options_spec_tokens,
    paged_options,
    reference_options,
    transport_options,
    warm_up_lengths,
)

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class WorkerRuntime:
    """Everything one worker process serves with. Built once; `engine` is not started yet."""

    config: ServeConfig  # with every "auto" resolved
    model_config: ModelConfig
    engine: AsyncEngine
    layout: KVLayout
    transport: KVTransport | None  # None when built without one (single-engine baseline)
    codec: TextCodec | None
    limits: RequestLimits
    # rank 0's handle on the follower ranks (a dsv4.parallel.ranks.RankGroup); None: one rank
    ranks: object = None
    offload: WorkerOffload | None = None  # routed experts partly in host memory (issue 22)

    @property
    def layout_info(self) -> KVLayoutInfo:
        return KVLayoutInfo(
            version=self.layout.version,
            compat_hash=self.layout.compat_hash,
            block_stride_bytes=self.layout.block_stride_bytes,
            block_size_tokens=self.layout.block_size,
        )

    @property
    def eos_token_id(self) -> int:
        return self.model_config.eos_token_id

    def engine_request(self, request: GenerateRequest) -> Request:
        """The scheduler's request for a validated wire request (the same on P, D, colocated)."""
        sampling = request.sampling
        return Request(
            request.request_id,
            request.prompt_token_ids,
            max_new_tokens=sampling.max_new_tokens,
            sampling_params=sampling,
            eos_token_id=None if sampling.ignore_eos else self.eos_token_id,
            stop_token_ids=frozenset(sampling.stop_token_ids),
            priority=-request.priority,  # the wire says larger first, the scheduler lower first
        )


def load_weights(
    config: ServeConfig, offload: ExpertOffload | None = None
) -> tuple[torch.nn.Module, ModelConfig, TextCodec | None]:
    """The model (eval mode, on the configured device) and its tokenizer, if any; with
    `offload`, cold routed experts are loaded straight into host memory."""
    f = config.features
    if AUTO in (f.expert_weights, f.linear_weights):  # a caller that skipped start-up's plan
        config = resolve_weight_formats(config, planned_model_config(config), 0)  # bf16
    m = config.model
    dtype = _DTYPES[m.dtype]
    experts = config.features.expert_weights  # "checkpoint": MXFP4 / FP8 experts as stored
    linears = config.features.linear_weights  # "checkpoint": FP8 linears as stored
    if m.path == "tiny":
        from dsv4.config.model import tiny_config
        from dsv4.model.tiny import random_model
        from dsv4.text.tokenizer import build_tokenizer

        cfg = tiny_config()
        model = random_model(cfg, seed=m.seed, dtype=dtype, device=m.device,
                             expert_weights=experts, linear_weights=linears,
                             offload=offload, routing=m.random_routing)  # fmt: skip
        return model, cfg, TextCodec(build_tokenizer(cfg.vocab_size, cfg.bos_token_id))
    from dsv4.model.weights import load_model

    if m.is_random:  # random:DIR
        from dsv4.model.tiny import random_model

        cfg = ModelConfig.from_file(m.model_dir)
        on_gpu = m.device.startswith("cuda")
        model = random_model(cfg, seed=m.seed, dtype=dtype, device=m.device,
                             draw_on_device=on_gpu, expert_weights=experts,
                             linear_weights=linears, offload=offload,
                             routing=m.random_routing)  # fmt: skip
    else:
        model, cfg = load_model(m.path, dtype=dtype, device=m.device, expert_weights=experts,
                                linear_weights=linears, offload=offload)  # fmt: skip
    tokenizer_dir = m.tokenizer or m.model_dir
    try:
        codec = TextCodec.from_dir(tokenizer_dir)
    except CheckpointError as exc:  # a checkpoint without tokenizer.json serves token ids
        logger.warning("no tokenizer (%s): workers return no text", exc)
        codec = None
    return model, cfg, codec


def build_worker_runtime(
    config: ServeConfig, *, with_transport: bool = True, name: str = "engine"
) -> WorkerRuntime:
    """Load the model, size the KV cache, build the engine and (optionally) the transport,
    registering the cache's backing tensor with it."""
    model_cfg = planned_model_config(config)  # config.json only, before any weight
    _check_device(config.model.device)
    # with the model's config: kv_dtype auto is fp8 only for its 512-wide heads
    config = resolve_auto(config, has_cuda=torch.cuda.is_available(),
                          hostname=socket.gethostname(), pid=os.getpid(), model=model_cfg)  # fmt: skip
    # the plan (GPU, or model.device_memory_gib) before any weight: raises PlanDoesNotFit
    config, plan, offload = startup_offload(config, model_cfg, _DTYPES[config.model.dtype])
    # the step workspaces the engine allocates after the KV cache is sized (the plan's buffers)
    reserve = plan.buffer_bytes if plan is not None else 0
    ranks = start_ranks(config)  # None for one rank; else followers load alongside
    try:
        return _build(config, ranks, offload, with_transport=with_transport, name=name,
                      reserve_bytes=reserve)  # fmt: skip
    except BaseException as exc:
        if ranks is not None:
            ranks.close("start-up failed")
        if isinstance(exc, torch.OutOfMemoryError):
            raise DeviceOutOfMemory.at_startup(exc) from exc
        raise


def _check_device(device: str) -> None:
    """An explicit `cuda[:N]` must name a card this process sees: torch's own refusal is an
    AssertionError ("Torch not compiled with CUDA enabled"), reported as a bug's line."""
    if not device.startswith("cuda"):
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        raise ConfigError("model.device", device, f"this host has {count} CUDA device(s) "
                          "visible: give --device cpu (or auto), or a card it has")  # fmt: skip


def start_ranks(config: ServeConfig):
    """The follower ranks of a replica of `model.tensor_parallel_size` > 1 (a `RankGroup`,
    spawned and joined), or None for one rank."""
    if config.model.tensor_parallel_size == 1:
        return None
    from dsv4.parallel import check_shardable
    from dsv4.parallel.ranks import RankGroup
    from dsv4.serving.ports import free_port

    m = config.model  # refuse a world size the model cannot split before spawning anything
    check_shardable(planned_model_config(config), m.tensor_parallel_size,
                    expert_parallel=m.expert_parallel)  # fmt: skip
    return RankGroup.start(config, free_port())


def _build(
    config: ServeConfig,
    ranks,
    offload: ExpertOffload | None,
    *,
    with_transport: bool,
    name: str,
    reserve_bytes: int = 0,
) -> WorkerRuntime:
    started = time.perf_counter()
    model, model_cfg, codec = load_weights(config, offload)
    # stage times in the log: a slow start (a 43-layer model, offload, first JIT) says where
    logger.info("%s: weights of %s loaded in %.1f s%s", name, config.model.path,
                time.perf_counter() - started, device_memory_text(config))  # fmt: skip
    set_linear_activations_(model, config.features.linear_activations)  # W8A8 switch
    served_offload = apply_offload(model, offload, config.features.forward,
                                   kernels=kernel_config(config),
                                   max_decode_tokens=max_decode_tokens(config),
                                   mxfp4_layout=config.features.mxfp4_layout,
                                   staging_experts=config.features.expert_staging,
                                   moe_activations=config.features.moe_activations)  # fmt: skip
    if ranks is not None:
        from dsv4.parallel import shard_model

        shard_model(model, ranks.group, expert_parallel=config.model.expert_parallel)
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(
            config.model,
            max_model_len=min(
                config.model.max_model_len or 1 << 62, model_cfg.max_position_embeddings
            ),
        ),
    )
    spec_tokens = options_spec_tokens(config)
    pattern = apply_features(model, model_cfg, config)
    options = cache_options(config, pattern)
    layout = KVLayout.build(model_cfg, options)
    num_blocks = num_blocks_for(config, layout, reserve_bytes)
    s = config.scheduler
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=s.max_num_batched_tokens,
        max_num_seqs=s.max_num_seqs,
        max_model_len=config.model.max_model_len,
        num_speculative_tokens=spec_tokens,
        spec_budget=config.speculative.budget,
        prefill_chunk_plan=s.prefill_chunk_plan,
        prefill_chunk_group_size=s.prefill_chunk_group_size,
        chunk_area_budget=s.chunk_area_budget,
    )
    f = config.features
    reference = reference_options(config)
    engine_options = EngineOptions(
        options,
        scheduler_config,
        num_blocks,
        device=config.model.device,
        kernels=kernel_config(config),
        paged=paged_options(config),
        reference=reference,
        batched_sampling=f.batched_sampling,
        routing_stats=config.metrics.routing_stats,
        async_scheduling=engine_async_scheduling(config, ranks),
    )
    collectives = ONE_RANK
    if ranks is not None:  # the followers build the same runner at the same time
        from dsv4.parallel.ranks import rank_zero_setup

        collectives = rank_zero_setup(ranks, engine_options,
                                      expert_parallel=config.model.expert_parallel)  # fmt: skip
    core = build_engine_core(model, engine_options, collectives=collectives)
    logger.info("%s: engine built (%d KV blocks)%s", name, num_blocks, device_memory_text(config))
    if ranks is not None:  # before the warm-up: its steps run on every rank
        from dsv4.parallel.ranks import rank_zero_core

        core = rank_zero_core(core, ranks)
    if config.model.device.startswith("cuda"):
        s = config.scheduler
        lengths = warm_up_lengths(s.max_num_batched_tokens, config.model.max_model_len,
                                  powers_only=s.warm_up == "powers")  # fmt: skip
        role = config.worker.role
        # a prefill worker only samples first tokens: its warm-up needs no decode steps; a
        # colocated one also admits prompts beside a decoding request (mixed steps)
        mixed = tuple(n for n in lengths if n & (n - 1) == 0 or n == lengths[-1])
        started = time.perf_counter()
        core.warm_up(lengths, num_new_tokens=1 if role == "prefill" else 4,
                     mixed_lengths=mixed if role == "colocated" else ())  # fmt: skip
        logger.info("%s: warm-up (%d prompt lengths, graphs captured) in %.1f s%s", name,
                    len(lengths), time.perf_counter() - started, device_memory_text(config))  # fmt: skip
    if core.runner.routing_stats is not None:  # count served traffic only, not the warm-up
        core.runner.routing_stats.reset()
    if served_offload is not None:  # likewise the expert traffic (warm-up, graph capture)
        served_offload.reset_stats()
    roles = pattern.roles
    # Share of ratio-4 layers whose top-k comes from the IndexCache instead of their indexer.
    core.runner.index_cache_hit_ratio = roles.count("S") / len(roles) if roles else 0.0
    transport = None
    if with_transport:
        transport = make_transport(config.transfer.transport, **transport_options(config))
        transport.register(core.runner.cache.backing)
    limits = request_limits(
        config, vocab_size=model_cfg.vocab_size, max_model_len=config.model.max_model_len
    )
    logger.info(
        "%s: model %s, %d KV blocks of %d B (%s KV), layout %s, transport %s%s",
        name, config.model.path, num_blocks, layout.block_stride_bytes, options.kv_dtype,
        layout.compat_hash[:12], transport.kind if transport else "none",
        device_memory_text(config),
    )  # fmt: skip
    if offload is not None:
        logger.info("%s: %d of %d routed experts per layer in host memory, %d cache slots",
                    name, offload.num_offloaded, model_cfg.n_routed_experts,
                    offload.cache_slots)  # fmt: skip
    engine = AsyncEngine(core, name, step_timeout_s=config.scheduler.step_timeout_s)
    return WorkerRuntime(config, model_cfg, engine, layout, transport, codec, limits, ranks,
                         served_offload)  # fmt: skip


def device_memory_text(config: ServeConfig) -> str:
    """', X GiB allocated (peak Y)' on a CUDA device, for the start-up log: what the plan's
    accounting must cover; '' elsewhere."""
    if not config.model.device.startswith("cuda"):
        return ""
    dev = torch.device(config.model.device)
    gib = 1 << 30
    return (f", {torch.cuda.memory_allocated(dev) / gib:.2f} GiB allocated (peak "
            f"{torch.cuda.max_memory_allocated(dev) / gib:.2f})")  # fmt: skip
