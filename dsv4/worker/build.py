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
  `CPU_DEFAULT_KV_BUDGET_BYTES` is used (the host's RAM fraction would be far too much).
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
from dsv4.cache.packing import CacheOptions
from dsv4.config import ServeConfig, request_limits, resolve_auto
from dsv4.config.index_pattern import IndexPattern
from dsv4.config.model import ModelConfig
from dsv4.engine.async_engine import AsyncEngine
from dsv4.engine.core import EngineOptions, build_engine_core
from dsv4.errors import CheckpointError, ConfigError
from dsv4.model.fp8 import set_linear_activations_
from dsv4.model.indexer import set_skip_topk
from dsv4.model.offload_load import ExpertOffload
from dsv4.runner.kernel_bridge import hot_ops, kernel_choices
from dsv4.runner.paged import MetadataSwitches, PagedOptions, PagedSwitches
from dsv4.runner.paged.collectives import ONE_RANK
from dsv4.runner.reference import ReferenceOptions
from dsv4.runner.reference.slot_tables import SlotTableOptions
from dsv4.scheduler.config import SchedulerConfig
from dsv4.scheduler.request import Request
from dsv4.text.tokenizer import TextCodec
from dsv4.transfer import KVTransport, make_transport
from dsv4.types import GenerateRequest, KVLayoutInfo, RequestLimits
from dsv4.worker.fit import max_decode_tokens, planned_model_config
from dsv4.worker.offload import WorkerOffload, apply_offload, startup_offload
from kernels.backend import KernelBackendConfig

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BUDGET_BYTES = 512 << 20
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
    config = resolve_auto(
        config, has_cuda=torch.cuda.is_available(), hostname=socket.gethostname(), pid=os.getpid()
    )
    # the plan (GPU, or model.device_memory_gib) before any weight: raises PlanDoesNotFit
    config, plan, offload = startup_offload(
        config, planned_model_config(config), _DTYPES[config.model.dtype]
    )
    # the step workspaces the engine allocates after the KV cache is sized (the plan's buffers)
    reserve = plan.buffer_bytes if plan is not None else 0
    ranks = start_ranks(config)  # None for one rank; else followers load alongside
    try:
        return _build(config, ranks, offload, with_transport=with_transport, name=name,
                      reserve_bytes=reserve)  # fmt: skip
    except BaseException:
        if ranks is not None:
            ranks.close("start-up failed")
        raise


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
                                   mxfp4_layout=config.features.mxfp4_layout)  # fmt: skip
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
    num_blocks = _num_blocks(config, layout, reserve_bytes)
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


def engine_async_scheduling(config: ServeConfig, ranks) -> bool:
    """features.async_scheduling where its launched-ahead steps can run: decode graphs with
    in-graph greedy tokens on one rank (rank 0 sends each step to its followers from `execute`, which a step launched
    ahead bypasses). Elsewhere the switch is inert: steps run one after another."""
    f = config.features
    if not (f.async_scheduling and f.greedy_in_graph) or ranks is not None:
        return False  # (graph_options would also warn again about several ranks' graphs)
    return graph_options(config) is not None  # None: no decode graphs (CPU, prefill, eager)


def options_spec_tokens(config: ServeConfig) -> int:
    """Draft slots the cache reserves: MTP's draft tokens, 0 without speculation."""
    s = config.speculative
    return s.num_speculative_tokens if s.method == "mtp" else 0


def cache_options(config: ServeConfig, pattern: IndexPattern) -> CacheOptions:
    """The KV cache's options (block size, formats, draft slots, IndexCache roles): the same
    on every rank of a replica and on both sides of a hand-off."""
    return CacheOptions(
        block_size=config.cache.block_size,
        kv_dtype=config.cache.kv_dtype,
        index_dtype=config.cache.indexer_key_dtype,
        num_speculative_tokens=options_spec_tokens(config),
        index_pattern=pattern.roles,
    )


def transport_options(config: ServeConfig) -> dict:
    """`make_transport` options: the pull timeout, and for NIXL the network devices UCX may
    listen on and use (only the interface `worker.host` binds, so a loopback worker opens no
    socket on another interface)."""
    t = config.transfer
    options: dict = {"pull_timeout_s": t.pull_timeout_s}
    if t.transport == "nixl":
        from dsv4.transfer.ucx_devices import ucx_net_devices

        devices = t.ucx_net_devices
        if devices in ("auto", "all"):
            devices = ucx_net_devices(config.worker.host) if devices == "auto" else ""
        options["net_devices"] = devices
    return options


def reference_options(config: ServeConfig) -> ReferenceOptions:
    """How the reference forward loads states (rank 0's engine and every follower rank)."""
    f = config.features
    return ReferenceOptions(
        shared_slot_tables=f.shared_sparse_metadata,
        kernels=kernel_config(config),
        slot_tables=SlotTableOptions(
            cached_token_to_req=f.cached_token_to_req_indices,
            skip_redundant_fill=f.skip_redundant_fill,
        ),
    )


def paged_options(config: ServeConfig) -> PagedOptions | None:
    """The paged forward's switches and decode graphs, None for the reference forward."""
    f = config.features
    if f.forward != "paged":
        return None
    metadata = MetadataSwitches(
        shared=f.shared_sparse_metadata,
        cached_token_to_req=f.cached_token_to_req_indices,
        skip_redundant_fill=f.skip_redundant_fill,
    )
    switches = PagedSwitches(compressor_boundary_only=f.compressor_boundary_only,
                             skip_topk=f.skip_topk, fuse_shared_expert=f.fuse_shared_expert,
                             attention_all_heads=f.attention_all_heads,
                             indexer_variants=f.indexer_variants,
                             expert_prefetch=f.expert_prefetch,
                             mxfp4_layout=f.mxfp4_layout)  # fmt: skip
    return PagedOptions(metadata, switches, graph_options(config))


def warm_up_lengths(
    budget: int, max_model_len: int, *, powers_only: bool = False
) -> tuple[int, ...]:
    """Prompt lengths of the start-up requests, so that kernels compile before traffic.

    A Triton kernel compiles once per (block-size class, argument specialisation): our
    launchers pick blocks from next_power_of_2 of token and entry counts, and Triton
    specialises every integer argument on "divisible by 16". Per power of two 2^p (16 up to
    the largest prompt one step takes) the lengths 2^p, 2^p - 1, 2^p - 16 and 2^p - 63 give
    tokens / ratio-4 entries of (div, div), (odd, odd), (div, not), (odd, div); then that
    largest prompt, then (when longer) a max-length prompt whose chunks walk the context
    through its classes. Measured on the H200: after one 8696-token warm-up a 4459-token
    prompt took 1.55 s, after power-of-two warm-ups only 8.6 s, instead of ~0.1 s warm.
    `powers_only` (`scheduler.warm_up=powers`): 2^p alone per class, for workers whose
    warm-up prompts are costly (expert offload), and whose traffic then pays those compiles."""
    longest = max(1, max_model_len - 8)
    largest = min(budget, longest)
    lengths = {largest}
    offsets = (0,) if powers_only else (0, 1, 16, 63)
    for p in range(4, largest.bit_length() + 1):
        lengths.update(n for n in ((1 << p) - o for o in offsets) if 0 < n <= largest)
    return (*sorted(lengths), *((longest,) if longest > largest else ()))


def graph_options(config: ServeConfig):
    """CUDA graphs of the decode step: the paged forward on CUDA with features.cuda_graphs, on
    workers that decode (a prefill worker never runs a decode-only step), with several ranks
    only over NCCL (a graph cannot capture gloo's all-reduce: those run eager, with a warning)."""
    f = config.features
    if f.forward != "paged" or not f.cuda_graphs or not config.model.device.startswith("cuda"):
        return None
    if config.worker.role == "prefill":
        return None
    if config.model.tensor_parallel_size > 1:
        from dsv4.parallel.ranks import backend_of

        if backend_of(config) != "nccl":
            logger.warning("%d ranks over %s: decode steps run eager (CUDA graphs cannot "
                           "capture its all-reduces; use nccl)", config.model.tensor_parallel_size,
                           backend_of(config))  # fmt: skip
            return None
    from dsv4.runner.paged.decode_graphs import GraphOptions

    max_batch = min(f.cuda_graph_max_batch, config.scheduler.max_num_seqs)
    return GraphOptions(max_batch=max_batch, max_model_len=config.model.max_model_len,
                        greedy_argmax=f.greedy_in_graph)  # fmt: skip


def kernel_config(config: ServeConfig) -> KernelBackendConfig:
    """The kernel backend of every op: model.kernels, per-op overrides, features.router_kernel."""
    overrides = dict(item.partition("=")[::2] for item in config.model.kernel_overrides)
    if config.features.router_kernel == "reference":
        overrides.update(route="ref", hash_route="ref")
    return KernelBackendConfig(default=config.model.kernels, overrides=overrides)


def apply_features(model: torch.nn.Module, model_cfg: ModelConfig, config: ServeConfig):
    """Model-side speed switches: IndexCache pattern, top-k skip, kernels, fused first mHC.

    Returns the IndexCache pattern (the cache layout must drop Shared layers' indexer keys)."""
    f = config.features
    pattern = IndexPattern.from_features(
        model_cfg, f.index_cache, f.index_topk_freq, f.index_topk_pattern
    )
    model.set_index_pattern(pattern)
    model.fuse_first_hc = f.fused_mhc
    set_skip_topk(f.skip_topk)
    kernels, device = kernel_config(config), config.model.device
    model.use_hot_ops(hot_ops(kernels, device))
    chosen = kernel_choices(kernels, device)
    logger.info("kernels: %s; index pattern %s", chosen, pattern.roles or "off")
    return pattern


def _num_blocks(config: ServeConfig, layout: KVLayout, reserve_bytes: int = 0) -> int:
    """KV blocks: `cache.num_blocks`, else what `cache.memory_budget_bytes` holds, else on a
    GPU `kv_budget_bytes` of its free memory."""
    c = config.cache
    if c.num_blocks:
        return c.num_blocks
    budget = c.memory_budget_bytes
    if not budget:
        if config.model.device.startswith("cuda"):
            dev = torch.device(config.model.device)
            free_bytes, _ = torch.cuda.mem_get_info(dev)
            within = int(config.model.device_memory_gib * (1 << 30))
            budget = kv_budget_bytes(free_bytes, c.memory_fraction, reserve_bytes,
                                     within, torch.cuda.memory_reserved(dev))  # fmt: skip
        else:
            budget = CPU_DEFAULT_KV_BUDGET_BYTES
    num_blocks = layout.num_blocks_for_budget(budget)
    if num_blocks < layout.num_blocks_for_request(config.cache.block_size):
        raise ConfigError(
            "cache.memory_budget_bytes", budget, "too small for one request: raise it"
        )
    return num_blocks


def kv_budget_bytes(free_bytes: int, fraction: float, reserve_bytes: int,
                    within_bytes: int = 0, held_bytes: int = 0) -> int:  # fmt: skip
    """The KV cache's bytes on a GPU: `fraction` of the free memory less `reserve_bytes`, the
    step workspaces the engine allocates after the cache (the plan's buffers). Sized from all
    of the free memory, the cache left a 43-layer offload worker's first 8K-token step 0.4 GiB
    for a 1 GiB scratch on an H100. With a device budget (`within_bytes`,
    `model.device_memory_gib`; `held_bytes` already taken) it stays inside that budget too."""
    budget = int(free_bytes * fraction) - reserve_bytes
    if within_bytes:
        budget = min(budget, int(within_bytes * fraction) - held_bytes - reserve_bytes)
    return max(budget, 0)
