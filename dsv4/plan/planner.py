"""The memory plan of one GPU and its verdict: fits / fits with K experts per layer offloaded
to pinned host memory / does not fit (and by how much).

    plan = plan_memory(PlanRequest(shape_config("flash"), num_gpus=1, gpu_mem_gib=141,
                                   host_mem_gib=512))
    print(plan.message)
    check_fits(plan)  # worker start-up: raises PlanDoesNotFit before anything is loaded

Usable device memory = gpu_mem x memory_fraction - runtime_reserve (CUDA context, cuBLAS and
NCCL workspaces, allocator slack). KV is sized for max_num_seqs requests of max_model_len
tokens each (no preemption needed). Offload keeps, per MoE layer, `E_local - K` experts
resident plus `cache_slots` device slots through which the K cold experts (held in pinned host
memory) are fetched; K is the smallest count that makes the plan fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from dsv4.cache.packing import CacheOptions
from dsv4.config.model import ModelConfig
from dsv4.errors import ConfigError, Dsv4Error
from dsv4.plan.budget import (
    Buffer,
    KVPlan,
    area_budget_rows,
    cuda_graph_pool,
    dequant_workspace,
    kv_plan,
    mtp_buffers,
    step_workspace,
)
from dsv4.plan.verdict import DOES_NOT_FIT, FITS, decide
from dsv4.plan.weights import WeightFormats, WeightItem, expert_bytes, experts_per_gpu, weight_items

GIB = 1024**3


class PlanDoesNotFit(Dsv4Error):
    """The model, cache and workspaces do not fit the GPUs (and host) given; names the shortfall."""

    grpc_code = "RESOURCE_EXHAUSTED"


@dataclass(frozen=True)
class PlanRequest:
    model: ModelConfig
    num_gpus: int = 1
    gpu_mem_gib: float = 80.0
    host_mem_gib: float = 0.0  # per node, shared by its GPUs; 0: no expert offload
    gpus_per_node: int = 0  # GPUs that share one host's memory; 0: min(num_gpus, 8)
    tp: int = 0  # 0: num_gpus
    ep: int = 0  # 0: num_gpus (1 GPU: no EP)
    max_model_len: int = 65536
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    num_speculative_tokens: int = 0  # > 0: MTP on (its weights, KV and draft buffers count)
    cuda_graphs: bool = True
    memory_fraction: float = 0.9
    runtime_reserve_gib: float = 1.0
    host_mem_fraction: float = 0.8  # share of host RAM that may be pinned for experts
    cache_slots: int = 0  # device slots per layer for cold experts; 0: num_experts_per_tok
    staging_experts: int = 0  # with offload: one prefill staging buffer of N experts, all layers
    # with offload, the reference forward's store of an idle layer (`MemoryPlan.idle_moe_layers`)
    # holds `cache_slots` device slots too; the paged forward's pool gives it none
    idle_layer_slots: bool = False
    h2d_gb_per_s: float = 25.0  # pinned host->device bandwidth for the fetch estimate
    tpot_slo_ms: float = 50.0  # an offload whose fetch estimate exceeds it is flagged
    formats: WeightFormats = field(default_factory=WeightFormats)
    cache: CacheOptions = field(default_factory=CacheOptions)

    def resolved(self) -> PlanRequest:
        """Fill the 0-means-derive fields and validate; raises ConfigError."""
        tp = self.tp or self.num_gpus
        ep = self.ep or self.num_gpus
        cfg = self.model
        if self.num_gpus < 1:
            raise ConfigError("gpus", self.num_gpus, "give at least 1 GPU")
        per_node = min(self.gpus_per_node or 8, self.num_gpus)
        if self.gpus_per_node < 0 or self.num_gpus % per_node:
            raise ConfigError(
                "gpus_per_node", self.gpus_per_node, f"must divide --gpus {self.num_gpus}"
            )
        if not self.tpot_slo_ms > 0:
            raise ConfigError("tpot_slo_ms", self.tpot_slo_ms, "give a positive SLO, e.g. 50")
        if not (math.isfinite(self.h2d_gb_per_s) and self.h2d_gb_per_s > 0):
            raise ConfigError(
                "h2d_gb_per_s", self.h2d_gb_per_s, "give a positive bandwidth, e.g. 55"
            )
        if self.num_gpus % tp or self.num_gpus % ep:
            raise ConfigError("tp/ep", (tp, ep), f"each must divide --gpus {self.num_gpus}")
        if cfg.num_attention_heads % tp or cfg.o_groups % tp:
            raise ConfigError("tp", tp, f"must divide o_groups={cfg.o_groups} (and the heads)")
        if ep > cfg.n_routed_experts:
            raise ConfigError("ep", ep, f"at most n_routed_experts={cfg.n_routed_experts}")
        if not self.gpu_mem_gib > 0:
            raise ConfigError("gpu_mem_gib", self.gpu_mem_gib, "give device memory in GiB (> 0)")
        if not self.host_mem_gib >= 0:
            raise ConfigError("host_mem_gib", self.host_mem_gib, "give host memory in GiB (>= 0)")
        slots = self.cache_slots or cfg.num_experts_per_tok
        cache = replace(self.cache, num_speculative_tokens=self.num_speculative_tokens)
        return replace(self, tp=tp, ep=ep, gpus_per_node=per_node, cache_slots=slots, cache=cache)


@dataclass(frozen=True)
class MemoryPlan:
    request: PlanRequest  # resolved
    weights: tuple[WeightItem, ...]
    expert_bytes: int  # one routed expert as held on one GPU (its TP shard without EP)
    experts_per_layer: int  # routed experts per MoE layer on one GPU
    num_moe_layers: int  # main layers (+ the MTP layer when speculative decoding is on)
    # MoE layers loaded that never run: the MTP layer when speculative decoding is off (the
    # loaders build it whenever the checkpoint has one), and their device bytes besides the
    # routed experts (`idle_layer_bytes`)
    idle_moe_layers: int
    idle_bytes: int
    kv: KVPlan
    buffers: tuple[Buffer, ...]  # workspaces, CUDA graph pool, MTP draft buffers
    usable_bytes: int
    verdict: str
    offloaded_per_layer: int  # K (for DOES_NOT_FIT: the K that was tried)
    cache_slots: int  # device slots per layer for cold experts (0 without offload)
    host_bytes: int  # pinned host memory for the offloaded experts of ONE GPU
    host_usable_bytes: int  # of one node (its GPUs share it)
    message: str

    @property
    def weight_bytes(self) -> int:
        return sum(w.per_gpu_bytes for w in self.weights)

    @property
    def routed_expert_bytes(self) -> int:
        return sum(w.per_gpu_bytes for w in self.weights if w.kind == "routed_experts")

    @property
    def buffer_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    @property
    def device_expert_bytes(self) -> int:
        """Routed expert bytes on the device after offload (resident + cache slots, and the
        prefill staging buffer when something is offloaded)."""
        slots = self.experts_per_layer - self.offloaded_per_layer + self.cache_slots
        return (self.num_moe_layers * slots + self.staging_experts) * self.expert_bytes

    @property
    def idle_device_bytes(self) -> int:
        """The idle layers' device bytes: `idle_bytes` and their routed experts, all of them
        without offload; with it they all wait in host memory, and only the reference
        forward's store keeps its cache slots for them on the device."""
        experts = self.experts_per_layer
        if self.offloaded_per_layer:
            experts = self.cache_slots if self.request.idle_layer_slots else 0
        return self.idle_bytes + self.idle_moe_layers * experts * self.expert_bytes

    @property
    def staging_experts(self) -> int:
        """The prefill staging buffer's experts (only with offload)."""
        return self.request.staging_experts if self.offloaded_per_layer else 0

    @property
    def needed_bytes(self) -> int:
        """Device bytes of this plan (after offload, if any)."""
        fixed = self.weight_bytes - self.routed_expert_bytes + self.buffer_bytes
        return fixed + self.device_expert_bytes + self.kv.total_bytes + self.idle_device_bytes

    @property
    def node_host_bytes(self) -> int:
        """Pinned host memory of one node: every GPU on it holds its own offloaded experts."""
        return self.host_bytes * self.request.gpus_per_node

    @property
    def fetch_ms_per_token(self) -> float:
        """Upper bound on the expert fetch time per decode token under uniform routing: a
        token misses top_k * K / E experts per layer (the hot-expert cache and skewed routing
        only lower it)."""
        req = self.request
        if not self.offloaded_per_layer:
            return 0.0
        missed = req.model.num_experts_per_tok * self.offloaded_per_layer / self.experts_per_layer
        per_token = self.num_moe_layers * missed * self.expert_bytes
        return per_token / (req.h2d_gb_per_s * 1e9) * 1e3

    @property
    def fits(self) -> bool:
        return self.verdict != DOES_NOT_FIT


def plan_memory(request: PlanRequest) -> MemoryPlan:
    """The per-GPU plan for `request` (pure arithmetic; loads nothing)."""
    req = request.resolved()
    cfg, tp, ep = req.model, req.tp, req.ep
    spec_on = req.num_speculative_tokens > 0
    served = cfg if spec_on else cfg.with_overrides(num_nextn_predict_layers=0)
    moe_tp = tp if ep == 1 else 1
    weights = weight_items(served, tp, ep, include_mtp=spec_on, formats=req.formats)
    kv = kv_plan(served, req.cache, req.max_model_len, req.max_num_seqs)
    area = area_budget_rows(served, req.max_model_len, req.max_num_batched_tokens)
    buffers = list(
        step_workspace(
            served, req.max_num_batched_tokens, req.max_num_seqs, tp, moe_tp,
            req.max_model_len, area,
        )
    )  # fmt: skip
    k = req.num_speculative_tokens
    stored = (experts_per_gpu(served, ep), moe_tp, req.formats.experts == "checkpoint",
              req.formats.linears == "checkpoint")  # fmt: skip
    buffers += dequant_workspace(served, req.max_num_batched_tokens, *stored)
    if req.cuda_graphs:
        buffers.append(cuda_graph_pool(served, req.max_num_seqs, k, tp, moe_tp))
        decode = dequant_workspace(served, req.max_num_seqs * (1 + k), *stored)
        buffers += [replace(b, name=f"cuda_graphs_{b.name}") for b in decode]  # their own pool
    if spec_on:
        buffers.append(mtp_buffers(served, req.max_num_seqs, k, tp))
    base = MemoryPlan(
        request=req,
        weights=weights,
        expert_bytes=expert_bytes(served, req.formats) // moe_tp,
        experts_per_layer=experts_per_gpu(served, ep),
        num_moe_layers=served.num_hidden_layers + (1 if spec_on else 0),
        idle_moe_layers=1 if cfg.has_mtp and not spec_on else 0,
        idle_bytes=idle_layer_bytes(req, kv),
        kv=kv,
        buffers=tuple(buffers),
        usable_bytes=int((req.gpu_mem_gib * req.memory_fraction - req.runtime_reserve_gib) * GIB),
        verdict=FITS,
        offloaded_per_layer=0,
        cache_slots=0,
        host_bytes=0,
        host_usable_bytes=int(req.host_mem_gib * req.host_mem_fraction * GIB),
        message="",
    )
    return decide(base)


def idle_layer_bytes(req: PlanRequest, served_kv: KVPlan) -> int:
    """Device bytes of the MTP layer that the loaders build but that never runs (speculative
    decoding off), besides its routed experts: its other weights (attention, shared expert,
    e_proj / h_proj, norms: 0.16 GiB at V4-Flash) and the KV rings the cache layout holds for it
    (the layout has every layer the model has). 0 when it runs or the model has none."""
    cfg = req.model
    if req.num_speculative_tokens > 0 or not cfg.has_mtp:
        return 0
    items = weight_items(cfg, req.tp, req.ep, include_mtp=True, formats=req.formats)
    weights = sum(w.per_gpu_bytes for w in items if w.is_mtp and w.kind != "routed_experts")
    loaded_kv = kv_plan(cfg, req.cache, req.max_model_len, req.max_num_seqs)
    return weights + loaded_kv.total_bytes - served_kv.total_bytes


def check_fits(plan: MemoryPlan) -> MemoryPlan:
    """Start-up guard: raise `PlanDoesNotFit` with the plan's message unless it fits."""
    if not plan.fits:
        raise PlanDoesNotFit(plan.message)
    return plan
