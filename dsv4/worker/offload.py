"""Expert offload in a worker (issue 22): V4-Flash's routed experts on one GPU + pinned host RAM.

Start-up, before any weight is loaded (`startup_offload`): the memory plan with the host budget
(`model.host_memory_gib`) says how many experts per layer (K) go to host memory and how many
device cache slots fetch them; the host must really have that memory available; the residency
file (`model.expert_residency`) says which experts stay on the device. The loaders then put
resident experts straight on the device and cold ones straight into pinned host memory
(`dsv4.model.offload_load`), and `apply_offload` is the one call site that puts the offload
under the engine's forward.

The forward: the reference forward's `OffloadedExperts` stores (`dsv4.model.offload`). The
paged forward's expert pool (`dsv4.runner.paged.expert_pool`) is not wired yet, so
`features.forward=paged` with offload is refused; `auto` picks the reference forward then.
"""

from __future__ import annotations

import dataclasses
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
from dsv4.worker.fit import GIB, size_text, startup_plan

logger = logging.getLogger(__name__)
PAGED_REFUSAL = (
    "expert offload runs on the reference forward for now (the paged forward's expert pool is "
    "not wired in): use --forward reference or auto, or --host-memory-gib 0"
)


@dataclass(frozen=True)
class WorkerOffload:
    """What a worker serves with: the plan's offload and one store per MoE layer."""

    offload: ExpertOffload
    stores: tuple[OffloadedExperts, ...]

    def stats(self) -> ExpertStats:
        """The stores' counters, summed (plain ints: safe to read from the metrics thread)."""
        total = ExpertStats()
        for store in self.stores:
            total.add(store.stats)
        return total


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
    config: ServeConfig, model_cfg: ModelConfig, asked_forward: str, dtype: torch.dtype
) -> tuple[ServeConfig, MemoryPlan | None, ExpertOffload | None]:
    """(config, plan, offload) before any weight is loaded: the plan for the GPU (or for
    `model.device_memory_gib`), and with it K and cache slots when the model needs offload.
    `asked_forward` is `features.forward` as given: "auto" turns to the reference forward when
    the plan offloads. Raises PlanDoesNotFit or ConfigError in one line."""
    m = config.model
    if not (m.device.startswith("cuda") or m.device_memory_gib):
        if m.host_memory_gib:
            raise ConfigError("model.host_memory_gib", m.host_memory_gib, "offload on a CPU "
                              "device needs a device budget: give model.device_memory_gib")  # fmt: skip
        return config, None, None
    total = int(m.device_memory_gib * GIB) or torch.cuda.get_device_properties(
        torch.device(m.device)).total_memory  # fmt: skip
    plan = startup_plan(config, model_cfg, total)
    if plan.offloaded_per_layer and config.features.forward == "paged" and asked_forward == "auto":
        logger.info("expert offload: features.forward auto -> reference (%s)", PAGED_REFUSAL)
        features = dataclasses.replace(config.features, forward="reference")
        config = dataclasses.replace(config, features=features)
        plan = startup_plan(config, model_cfg, total)  # no CUDA graph pool on this path
    return config, plan, expert_offload(config, plan, model_cfg, dtype)


def expert_offload(
    config: ServeConfig, plan: MemoryPlan, model_cfg: ModelConfig, dtype: torch.dtype
) -> ExpertOffload | None:
    """The plan's K and cache slots with the residency order, None when nothing is offloaded."""
    k = plan.offloaded_per_layer
    if not k:
        return None
    check_forward(config.features.forward)
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


def check_forward(forward_kind: str) -> None:
    """The forwards that serve offloaded experts: the reference one, for now."""
    if forward_kind == "paged":
        raise ConfigError("features.forward", "paged", PAGED_REFUSAL)


def apply_offload(
    model: torch.nn.Module, offload: ExpertOffload | None, forward_kind: str
) -> WorkerOffload | None:
    """Serve `model` with `offload` on the `forward_kind` forward: the one call site that picks
    the expert path. Reference: the stores the loader built (a MoE layer loaded whole is
    offloaded here). Paged: refused until the paged expert pool is wired in here."""
    if offload is None:
        return None
    check_forward(forward_kind)  # the paged forward: pool_experts(model, PoolOptions(...)) here
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
