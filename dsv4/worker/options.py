"""ServeConfig -> the option objects the engine, model and transport are built with: one place
that reads `features.*` for the forward's switches, the decode graphs, the kernel backends,
the cache format and the start-up warm-up prompts (`dsv4.worker.build` assembles them)."""

from __future__ import annotations

import logging

import torch

from dsv4.cache.packing import CacheOptions
from dsv4.config import ServeConfig
from dsv4.config.index_pattern import IndexPattern
from dsv4.config.model import ModelConfig
from dsv4.model.indexer import set_skip_topk
from dsv4.runner.kernel_bridge import hot_ops, kernel_choices
from dsv4.runner.paged import MetadataSwitches, PagedOptions, PagedSwitches
from dsv4.runner.reference import ReferenceOptions
from dsv4.runner.reference.slot_tables import SlotTableOptions
from kernels.backend import KernelBackendConfig

logger = logging.getLogger(__name__)


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
                             mxfp4_layout=f.mxfp4_layout,
                             moe_activations=f.moe_activations)  # fmt: skip
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
