"""Expert offload in a worker (issue 22): V4-Flash's routed experts on one GPU + pinned host RAM.

Start-up, before any weight is loaded (`startup_offload`): the memory plan with the host budget
(`model.host_memory_gib`) says how many experts per layer (K) go to host memory and how many
device cache slots fetch them; the host must really have that memory available; the residency
file (`model.expert_residency`) says which experts stay on the device. The loaders then put
resident experts straight on the device and cold ones straight into pinned host memory
(`dsv4.model.offload_load`), and `apply_offload` is the one call site that puts the offload
under the engine's forward.

The forward: the reference forward serves the `OffloadedExperts` stores (`dsv4.model.offload`);
the paged forward (`features.forward=paged`, and `auto` on CUDA) moves them into one expert
pool per layer (`dsv4.runner.paged.pool_experts`): resident experts and cache slots in one
device storage, cold experts in pinned host memory, misses resolved and copied by kernels
inside the captured decode graphs. Either way the counters feed the `ExpertCollector`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from dsv4.config import ServeConfig
from dsv4.config.model import ModelConfig
from dsv4.errors import ConfigError
from dsv4.model.moe import MoE, served_expert_format
from dsv4.model.offload import ExpertStats, OffloadedExperts, offload_moe
from dsv4.model.offload_load import ExpertOffload, expert_format
from dsv4.plan import MemoryPlan, PlanDoesNotFit
from dsv4.plan.residency import ResidencyError
from dsv4.plan.residency import read_residency as load_residency
from dsv4.runner.paged import ExpertPool, PoolOptions, PoolStats, pool_experts
from dsv4.worker.fit import GIB, device_plan, resolve_weight_formats, size_text
from kernels.backend import KernelBackendConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerOffload:
    """What a worker serves with: the plan's offload and, on the reference forward, one store
    per MoE layer, or on the paged forward the expert pool."""

    offload: ExpertOffload
    stores: tuple[OffloadedExperts, ...] = ()
    pool: ExpertPool | None = None

    def stats(self) -> ExpertStats | PoolStats:
        """The counters, summed (plain ints, read from host memory: safe to read from the
        metrics thread; the pool's are those of its last mirrored step)."""
        if self.pool is not None:
            return self.pool.stats()
        total = ExpertStats()
        for store in self.stores:
            total.add(store.stats)
        return total

    def reset_stats(self) -> None:
        """After warm-up and graph capture: count served traffic only."""
        if self.pool is not None:
            self.pool.reset_stats()
        for store in self.stores:
            store.stats = ExpertStats()


def read_residency(path: str, cfg: ModelConfig) -> tuple[tuple[int, ...], ...]:
    """Per MoE layer (layers 0..L-1, then the MTP layer), expert ids most used first: the
    order of a residency file (`dsv4 plan --routing-stats ... --residency-out F`, format
    `dsv4.plan.residency`), checked against this model's shape. The plan's K decides how many
    of each order stay on the device, not the file's `num_resident`."""
    try:
        residency = load_residency(path, num_moe_layers(cfg), cfg.n_routed_experts)
    except ResidencyError as exc:
        raise ConfigError("model.expert_residency", path, exc.message) from exc
    return residency.order


def num_moe_layers(cfg: ModelConfig) -> int:
    """MoE layers the loaded model holds: every layer, and the MTP layer when it has one (it is
    offloaded alike, whether or not speculative decoding uses it)."""
    return cfg.num_hidden_layers + (1 if cfg.has_mtp else 0)


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_memory(needed: int, budget: int, available: int | None, what: str) -> None:
    """Refuse (one line) an offload whose cold experts (`what`) exceed the pinned budget
    (`model.host_memory_gib`) or the host's available memory."""
    if needed > budget:
        raise PlanDoesNotFit(f"needs {size_text(needed)} of pinned host memory for {what};"
                             f" --host-memory-gib gives {budget / GIB:g}")  # fmt: skip
    if available is not None and needed > available:
        raise PlanDoesNotFit(f"needs {size_text(needed)} of pinned host memory for {what};"
                             f" this host has {size_text(available)} available")  # fmt: skip


def startup_offload(
    config: ServeConfig, model_cfg: ModelConfig, dtype: torch.dtype
) -> tuple[ServeConfig, MemoryPlan | None, ExpertOffload | None]:
    """(config, plan, offload) before any weight is loaded: the plan for the GPU (or for
    `model.device_memory_gib`), and with it K and cache slots when the model needs offload.
    Both forwards serve offload (the paged one through its expert pool), so `features.forward`
    stays as resolved. Raises PlanDoesNotFit or ConfigError in one line."""
    m = config.model
    if not (m.device.startswith("cuda") or m.device_memory_gib):
        if m.host_memory_gib:
            raise ConfigError("model.host_memory_gib", m.host_memory_gib, "offload on a CPU "
                              "device needs a device budget: give model.device_memory_gib")  # fmt: skip
        return resolve_weight_formats(config, model_cfg, 0), None, None  # no plan: bf16
    total = int(m.device_memory_gib * GIB) or torch.cuda.get_device_properties(
        torch.device(m.device)).total_memory  # fmt: skip
    config, plan = device_plan(config, model_cfg, total)
    return config, plan, expert_offload(config, plan, model_cfg, dtype)


def expert_offload(
    config: ServeConfig, plan: MemoryPlan, model_cfg: ModelConfig, dtype: torch.dtype
) -> ExpertOffload | None:
    """The plan's K and cache slots with the residency order, None when nothing is offloaded."""
    k = plan.offloaded_per_layer
    if not k:
        return None
    served = served_expert_format(model_cfg, config.features.expert_weights)
    fmt = expert_format(served, model_cfg.hidden_size, model_cfg.moe_intermediate_size, dtype)
    e, planned = model_cfg.n_routed_experts, plan.num_moe_layers
    unplanned = num_moe_layers(model_cfg) - planned  # an MTP layer that never runs: all cold
    what = f"{k} of {e} experts x {planned} layers"
    if unplanned > 0:
        what += f" + all {e} of the unused MTP layer"
    cold = planned * k + max(0, unplanned) * e
    budget = int(config.model.host_memory_gib * GIB)
    check_host_memory(cold * fmt.nbytes, budget, available_host_bytes(), what)
    path = config.model.expert_residency
    hot = read_residency(path, model_cfg) if path else ()
    return ExpertOffload(k, plan.cache_slots, hot, planned_layers=planned)


def pool_options(offload: ExpertOffload, model_cfg: ModelConfig, max_decode_tokens: int,
                 mxfp4_layout: str = "stored", staging_experts: int = 0,
                 moe_activations: str = "bf16") -> PoolOptions:  # fmt: skip
    """The paged forward's pool per the plan: each layer's cold count and residency order,
    the plan's cache slots, raised to fit `max_decode_tokens` (max batch x (1 + drafts)), MXFP4
    rows in `mxfp4_layout` (`features.mxfp4_layout`), the prefill staging buffer's experts
    (`features.expert_staging`), the GEMMs' activations (`features.moe_activations`)."""
    e, layers = model_cfg.n_routed_experts, num_moe_layers(model_cfg)
    cold = tuple(offload.offloaded(i, e) for i in range(layers))
    order = tuple(tuple(offload.order(i, e)) for i in range(layers))
    return PoolOptions(cold, order, offload.cache_slots, max_decode_tokens, offload.planned_layers,
                       mxfp4_layout, staging_experts, moe_activations)  # fmt: skip


def apply_offload(
    model: torch.nn.Module,
    offload: ExpertOffload | None,
    forward_kind: str,
    *,
    kernels: KernelBackendConfig | None = None,
    max_decode_tokens: int = 1,
    mxfp4_layout: str = "stored",
    staging_experts: int = 0,
    moe_activations: str = "bf16",
) -> WorkerOffload | None:
    """Serve `model` with `offload` on the `forward_kind` forward: the one call site that picks
    the expert path. Reference: the stores the loader built (a MoE layer loaded whole is
    offloaded here). Paged: the expert pool (`pool_experts`), sized so a decode step of
    `max_decode_tokens` tokens fetches its misses in one round."""
    if offload is None:
        return None
    if forward_kind == "paged":
        cfg = model.cfg
        options = pool_options(offload, cfg, max_decode_tokens, mxfp4_layout, staging_experts,
                               moe_activations)  # fmt: skip
        device = model.embed.weight.device
        pool = pool_experts(model, options, device, kernels or KernelBackendConfig())
        slots = {layer.num_slots for layer in pool.layers}
        logger.info("expert pool: %s cache slots per layer (plan %d, decode steps of up to %d "
                    "tokens)", sorted(slots), offload.cache_slots, max_decode_tokens)  # fmt: skip
        return WorkerOffload(offload, pool=pool)
    stores = []
    for i, moe in enumerate(m for m in model.modules() if isinstance(m, MoE)):
        if moe.expert_store is None:  # loaded whole: move its experts now
            stacked = moe.stacked_experts
            fmt = "mxfp4" if stacked is not None and stacked.format == "mxfp4" else "dense"
            cold = offload.offloaded(i, moe.cfg.n_routed_experts)
            offload_moe(moe, cold, offload.cache_slots, fmt=fmt,
                        hot=offload.order(i, moe.cfg.n_routed_experts))  # fmt: skip
        stores.append(moe.expert_store)
    return WorkerOffload(offload, tuple(stores))
