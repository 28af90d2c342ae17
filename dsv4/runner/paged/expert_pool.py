"""Offloaded routed experts on the paged forward: one expert pool per MoE layer
(docs/architecture.md#expert-pool).

A layer's pool is one device storage in the served format (`ExpertWeights`: bf16, MXFP4 or
FP8, scales included) of R resident experts (rows [0, R)) and S cache slots (rows [R, R + S)),
a pinned host storage of the C = E - R cold experts in the same format (one row each, so a
fetch is a row copy), and the slot table of `dsv4/ops/expert_slots.py` on the device. A step,
after routing: `resolve_slots` maps the ids [T, K] to device rows and lists the misses' host
rows, `copy_fetched` copies them in through their device (UVA) addresses, and the grouped GEMM
runs on the rows (`kernels.moe.expert_rows` with num_experts = E, so tiles and paths are the
all-resident call's) then combines in k order: bit-identical to all-resident serving, and
kernels only, so it replays inside a captured decode graph with no host involvement.

S >= min(C, max_decode_tokens * top_k) puts every decode step's misses in one round; a larger
step (a prefill, eager) whose misses may not fit runs in rounds (`expert_rounds.py`). The pool
never holds the shared expert (so it is never fused). Errors (more misses than slots, a stale
table) set a device flag that `ExpertPool.check` turns into `ExpertPoolError` once the step's
output is on the host, so a bad step fails its requests instead of serving tokens; the pool
then drops every cached expert (back to its start-up table) and the next steps serve.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from dsv4.errors import ConfigError, ExpertPoolError
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.model.moe import ExpertWeights, MoE
from dsv4.ops.expert_slots import (
    COUNTER_NAMES,
    COUNTERS,
    ERRORS,
    MAX_SLOTS,
    SlotTable,
    error_text,
)
from dsv4.runner.paged.expert_rounds import experts_in_rounds
from dsv4.runner.paged.expert_staging import Staging
from dsv4.runner.paged.expert_staging_steps import experts_staged
from dsv4.runner.paged.pool_storage import (
    adopt_host_rows,
    drop_experts_,
    empty_rows,
    expert_rows_of,
    fill_,
)
from kernels.backend import KernelBackendConfig, resolve

logger = logging.getLogger(__name__)
STAT_COLUMNS = (*COUNTER_NAMES[:4], "prefetches", "copy_wait_ns")
_STAT_INDEX = [COUNTER_NAMES.index(name) for name in STAT_COLUMNS]


@dataclass(frozen=True)
class PoolOptions:
    """`num_offloaded[i]`: MoE layer i's cold experts (layers 0..L-1, then the MTP layer;
    missing layers: the last value); `order[i]`: its experts most used first (the first
    E - num_offloaded stay resident; completed in index order); `cache_slots`: slots per layer
    at least; `max_decode_tokens`: the largest decode step (batch x (1 + draft tokens)), which
    sizes the slots so a decode step's misses fit in one round; `planned_layers` (0: all):
    later layers never run (the MTP layer without speculation) and get no slots."""

    num_offloaded: tuple[int, ...]
    order: tuple[tuple[int, ...], ...] = ()
    cache_slots: int = 1
    max_decode_tokens: int = 1
    planned_layers: int = 0
    mxfp4_layout: str = "stored"  # MXFP4 rows: `dsv4.model.moe.MXFP4_LAYOUTS`
    staging_experts: int = 0  # prefill staging rows shared by all layers (0: rounds)
    moe_activations: str = "bf16"  # "fp8": W4A8 GEMMs on halves128 rows (kernels/moe_w4a8.py)

    def cold(self, layer: int) -> int:
        return self.num_offloaded[min(layer, len(self.num_offloaded) - 1)]

    def resident_ids(self, layer: int, num_experts: int) -> list[int]:
        given = self.order[layer] if layer < len(self.order) else ()
        order = [*given, *(e for e in range(num_experts) if e not in set(given))]
        return sorted(order[: num_experts - self.cold(layer)])

    def slots(self, layer: int, num_experts: int, top_k: int) -> int:
        cold = self.cold(layer)
        if self.planned_layers and layer >= self.planned_layers:
            return 0
        return min(cold, max(self.cache_slots, self.max_decode_tokens * top_k))


@dataclass(frozen=True)
class PoolStats:
    """Expert uses (one per expert a layer's step routes to) by where the weights were."""

    resident_hits: int = 0
    cache_hits: int = 0
    fetches: int = 0  # copied host -> device when the layer needed them (the misses)
    bytes_fetched: int = 0  # every copy, prefetches included
    prefetches: int = 0  # copied ahead of their layer, on the copy stream (pre-gating)
    cpu_computes: int = 0  # never on the paged forward (the ExpertCollector's series)
    # the compute stream's waits for copies, ns: a layer joining its prefetch, and a step's
    # own copy of its misses (`LayerPool.resolve`); on CPU, the copies' own time
    copy_wait_ns: int = 0

    @property
    def hits(self) -> int:
        return self.resident_hits + self.cache_hits

    @property
    def misses(self) -> int:
        return self.fetches

    @property
    def uses(self) -> int:
        return self.hits + self.fetches

    @property
    def hit_rate(self) -> float:
        return self.hits / self.uses if self.uses else 0.0

    @property
    def cache_hit_rate(self) -> float:
        cold = self.cache_hits + self.fetches
        return self.cache_hits / cold if cold else 0.0


class LayerPool:
    """One MoE layer's pool; `weights` ([R + S] rows) is what the grouped GEMM reads."""

    def __init__(self, weights: ExpertWeights, host: tuple[torch.Tensor, ...],
                 resident_ids: list[int], num_experts: int, counters: torch.Tensor,
                 kernels: KernelBackendConfig, activations: str = "bf16") -> None:  # fmt: skip
        device = weights.w13.device
        self.weights, self.host, self.counters = weights, host, counters
        self.activations = activations  # `features.moe_activations` of the rows' GEMMs
        self.owner_pool: ExpertPool | None = None  # set by the ExpertPool that holds it
        self.index = 0  # its place in the owner's layers (set there too)
        self.num_experts, self.num_resident = num_experts, len(resident_ids)
        self.num_slots = weights.w13.shape[0] - self.num_resident
        self.num_cold = host[0].shape[0]
        self.parts = tuple(t for t in (weights.w13, weights.w2, weights.w13_scale,
                                       weights.w2_scale) if t is not None)  # fmt: skip
        self.row_bytes = sum(math.prod(t.shape[1:]) * t.element_size() for t in host)
        cold_ids = [e for e in range(num_experts) if e not in set(resident_ids)]
        self.cold_rows = {e: i for i, e in enumerate(cold_ids)}  # logical id -> host row
        i32 = dict(dtype=torch.int32, device=device)
        self.table = torch.full((num_experts,), -1, **i32)
        self.table[resident_ids] = torch.arange(self.num_resident, **i32)
        self.owner = torch.full((self.num_resident + self.num_slots,), -1, **i32)
        self.owner[: self.num_resident] = torch.tensor(resident_ids, **i32)
        self.cold_row = torch.full((num_experts,), -1, **i32)
        self.cold_row[cold_ids] = torch.arange(len(cold_ids), **i32)
        self.last_used = torch.zeros(self.num_slots, dtype=torch.int64, device=device)
        self.fetch = torch.full((self.num_slots,), -1, **i32)
        # the start-up table and owners (resident rows only): what `forget_cached` restores
        self._initial = (self.table.clone(), self.owner.clone())
        self.slots = SlotTable(self.table, self.owner, self.last_used, self.cold_row, counters,
                               self.fetch, self.num_resident, self.row_bytes)  # fmt: skip
        self.ops = {name: resolve(name, kernels, device) for name in
                    ("resolve_slots", "prefetch_slots", "copy_fetched", "expert_rows",
                     "combine_rows", "copy_wait_start", "copy_wait_end")}  # fmt: skip
        # a prefetch in flight on the owner's copy stream: its ids, kept alive until joined
        self._prefetching: torch.Tensor | None = None

    def fits_one_round(self, num_pairs: int) -> bool:
        """Every miss of a step of `num_pairs` pairs finds a free slot (see the module doc)."""
        return num_pairs <= self.num_slots or self.num_slots >= self.num_cold

    def stages(self, num_pairs: int) -> bool:
        """A step of `num_pairs` pairs goes through the owner's staging buffer."""
        owner = self.owner_pool
        return (
            owner is not None and owner.staging is not None and not self.fits_one_round(num_pairs)
        )

    def prefetch(self, predicted: torch.Tensor) -> None:
        """Copy in the experts of a predicted routing [T, K] of this layer ahead of its step
        (`prefetch_slots`). On CUDA both launches go to the pool's copy stream after the work
        issued so far, so the copies overlap the compute stream's layers until this layer's
        `resolve` joins them; a captured graph records the fork and the join."""
        if not self.num_slots or self.stages(predicted.numel()):
            return  # a staged step never reads the slots
        stream = self.owner_pool.copy_stream if self.owner_pool is not None else None
        if stream is None:  # CPU: in order
            self._prefetch_now(predicted)
            return
        stream.wait_stream(torch.cuda.current_stream(predicted.device))
        with torch.cuda.stream(stream):
            self._prefetch_now(predicted)
        self._prefetching = predicted

    def _prefetch_now(self, predicted: torch.Tensor) -> None:
        self.ops["prefetch_slots"](predicted, self.slots)
        self.ops["copy_fetched"](self.fetch, self.parts, self.host, self.num_resident)

    def join_prefetch(self) -> None:
        """The compute stream waits for this layer's prefetch (if one is in flight), timed into
        `copy_wait_ns`: the start stamp runs once the compute stream reached the join, the end
        stamp once the copy stream's prefetch is done too (a layer with no prefetch in flight
        launches neither)."""
        if self._prefetching is None:
            return
        assert self.owner_pool is not None and self.owner_pool.copy_stream is not None
        self.ops["copy_wait_start"](self.counters)
        torch.cuda.current_stream(self._prefetching.device).wait_stream(self.owner_pool.copy_stream)
        self.ops["copy_wait_end"](self.counters)
        self._prefetching = None

    def resolve(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T, K] logical (-1: skipped) -> device rows [T, K] int32, the misses copied in.
        The copy is on the compute stream's critical path, so it is timed into `copy_wait_ns`
        (two one-program stamps around it, counted only when it copied a row); the placement
        (`resolve_slots`) is compute, not a wait, and stays outside the stamps."""
        self.join_prefetch()
        rows = self.ops["resolve_slots"](ids, self.slots)
        if self.num_slots:
            # stamps of their own (counters [COUNTERS], fetch [S]): the copy ends with the last
            # of its grid's programs, which only the next launch on the stream sees begin
            self.ops["copy_wait_start"](self.counters)
            self.ops["copy_fetched"](self.fetch, self.parts, self.host, self.num_resident)
            self.ops["copy_wait_end"](self.counters, self.fetch)
        return rows

    def rows(self, u: torch.Tensor, rows_of: torch.Tensor, limit: float | None,
             out: torch.Tensor | None = None, skip: bool = False,
             used_rows: torch.Tensor | None = None,
             storage: ExpertWeights | None = None) -> torch.Tensor:  # fmt: skip
        """The grouped GEMM's per-pair rows [T*K, D] on device rows `rows_of` [T, K] of
        `storage` (default: the pool's own; the staging buffer's for a staged prefill);
        `used_rows` (int32 [U]): every row `rows_of` names, when the caller knows them."""
        w = self.weights if storage is None else storage
        return self.ops["expert_rows"](u, rows_of, w.w13, w.w2, w.format, w.w13_scale,
                                       w.w2_scale, limit, rows=out, num_experts=self.num_experts,
                                       skip=skip, used_rows=used_rows,
                                       activations=self.activations)  # fmt: skip

    def experts(self, u: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                limit: float | None, lookahead: bool = False) -> torch.Tensor:  # fmt: skip
        """u [T, D], routed ids [T, K] and weights [T, K] fp32 -> y [T, D] fp32, as
        `moe_experts` on all-resident experts computes it; `lookahead`: a step in rounds
        prefetches each next round beside the current one (`expert_rounds.py`)."""
        if self.stages(ids.numel()):
            assert self.owner_pool is not None and self.owner_pool.staging is not None
            return experts_staged(self, self.owner_pool.staging, u, ids, weights, limit)
        if not self.fits_one_round(ids.numel()):
            return experts_in_rounds(self, u, ids, weights, limit, lookahead)
        rows = self.rows(u, self.resolve(ids), limit)
        return self.ops["combine_rows"](rows, weights, ids)

    def forget_cached(self) -> None:
        """Back to the start-up state after a failed step (whose table may be inconsistent):
        resident experts in their rows, every cache slot free; in place, so captured graphs
        keep their addresses. The next steps fetch their cold experts again."""
        self.join_prefetch()
        self.table.copy_(self._initial[0])
        self.owner.copy_(self._initial[1])
        self.last_used.zero_()
        self.fetch.fill_(-1)

    def find_leaks(self) -> list[str]:
        """The table and the owners disagree, or a resident expert left its row."""
        table, owner = self.table.tolist(), self.owner.tolist()
        out = [f"expert {e} -> row {r} owned by {owner[r]}" for e, r in enumerate(table)
               if r >= 0 and owner[r] != e]  # fmt: skip
        out += [f"row {r} holds {e}, the table says {table[e]}" for r, e in enumerate(owner)
                if e >= 0 and table[e] != r]  # fmt: skip
        return out


class ExpertPool:
    """Every MoE layer's pool; counters [L, COUNTERS] int64 on the device, mirrored to a host
    copy after each step (`mirror`) so `stats` and `check` never touch the device. Besides the
    expert uses, a row times its layer's waits for copies (`copy_wait_ns`, stamped on the
    device by `LayerPool.join_prefetch` and `resolve`)."""

    def __init__(self, layers: tuple[LayerPool, ...], counters: torch.Tensor,
                 staging: ExpertWeights | None = None) -> None:  # fmt: skip
        self.layers, self.counters = layers, counters
        # prefetches (LayerPool.prefetch) and staging copies run here, beside the compute stream
        self.copy_stream = torch.cuda.Stream(counters.device) if counters.is_cuda else None
        # prefill steps' cold experts (`features.expert_staging`; None: rounds through slots)
        self.staging = None if staging is None else Staging(staging, self.copy_stream)
        for i, layer in enumerate(layers):
            layer.owner_pool, layer.index = self, i
        self.host_counters = torch.zeros(counters.shape, dtype=torch.int64,
                                         pin_memory=counters.is_cuda)  # fmt: skip

    def mirror(self) -> None:
        """After a step's launches: its counters to the host copy (no sync; complete once the
        step's output is read)."""
        self.host_counters.copy_(self.counters, non_blocking=self.counters.is_cuda)

    def check(self, sync: bool = False) -> None:
        """Raise `ExpertPoolError` if a step since start-up could not place its experts (read
        after the step's output reached the host, so its counters copy is complete; `sync`:
        wait for the copy here, for steps that read their output before `mirror`)."""
        if sync and self.counters.is_cuda:
            torch.cuda.current_stream(self.counters.device).synchronize()
        bits = 0
        for value in self.host_counters[:, ERRORS].tolist():
            bits |= value
        if bits:  # the step fails its requests; the pool starts over for the next steps
            for layer in self.layers:
                layer.forget_cached()
            self.counters[:, ERRORS] = 0
            self.host_counters[:, ERRORS] = 0
            logger.error("expert pool: %s; the step's requests fail, cached experts dropped",
                         error_text(bits))  # fmt: skip
            raise ExpertPoolError(f"expert pool: {error_text(bits)}; the step's output is "
                                  "refused and its cached experts dropped")  # fmt: skip

    def stats(self) -> PoolStats:
        """Counters summed over layers, as of the last mirrored step (plain ints)."""
        sums = self.host_counters[:, _STAT_INDEX].sum(0).tolist()
        return PoolStats(**dict(zip(STAT_COLUMNS, sums)))

    def reset_stats(self) -> None:
        """Zero the counters (not the step or the error bits): after warm-up and capture."""
        self.counters[:, _STAT_INDEX] = 0
        self.host_counters[:, _STAT_INDEX] = 0

    @property
    def device_bytes(self) -> int:
        staged = self.staging.parts if self.staging is not None else ()
        parts = [t for p in self.layers for t in p.parts] + list(staged)
        return sum(t.numel() * t.element_size() for t in parts)

    def find_leaks(self) -> list[str]:
        out = [f"layer {i}: {leak}" for i, p in enumerate(self.layers) for leak in p.find_leaks()]
        bits = int(self.counters[:, ERRORS].max()) if self.layers else 0
        return out + ([f"error bits: {error_text(bits)}"] if bits else [])


def pool_experts(model: DeepseekV4, options: PoolOptions, device: torch.device | str,
                 kernels: KernelBackendConfig) -> ExpertPool:  # fmt: skip
    """Give every MoE layer of `model` (layers 0..L-1, then the MTP layer) an expert pool on
    `device` per `options`, from its offload store or its stacked experts, which are then
    dropped: the paged forward reads `moe.expert_pool`; the reference forward refuses."""
    device = torch.device(device)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    counters = torch.zeros(len(moes), COUNTERS, dtype=torch.int64, device=device)
    layers = []
    for i, moe in enumerate(moes):
        cfg = moe.cfg
        num, top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        if num > MAX_SLOTS:
            raise ConfigError("model.host_memory_gib", "> 0", f"the expert pool takes up to "
                              f"{MAX_SLOTS} experts a layer (this model: {num})")  # fmt: skip
        if not 0 <= options.cold(i) <= num:
            raise ValueError(f"layer {i}: {options.cold(i)} cold experts of {num}")
        source = expert_rows_of(moe, options.mxfp4_layout)
        resident = options.resident_ids(i, num)
        cold = [e for e in range(num) if e not in set(resident)]
        slots = options.slots(i, num, top_k) if cold else 0
        like = source.parts(0)
        storage = empty_rows(like, len(resident) + slots, device)
        for part in storage:  # free slots hold zeros, not garbage: a prefill-sized GEMM that
            part[len(resident) :].zero_()  # dequantises every row then reads finite codes
        adopted = adopt_host_rows(moe, source, cold, device)
        host = adopted or empty_rows(like, len(cold), torch.device("cpu"),
                                     pin=device.type == "cuda")  # fmt: skip
        with torch.no_grad():
            for row, e in enumerate(resident):
                fill_(storage, row, source.parts(e))
            for row, e in enumerate([] if adopted else cold):
                fill_(host, row, source.parts(e))
        drop_experts_(moe)
        if device.type == "cuda":  # hand the layer's old storage back before the next one
            torch.cuda.empty_cache()
        scales = storage[2:] if len(storage) > 2 else (None, None)
        weights = ExpertWeights(storage[0], storage[1], format=source.format,
                                w13_scale=scales[0], w2_scale=scales[1])  # fmt: skip
        layer = LayerPool(weights, host, resident, num, counters[i], kernels,
                          options.moe_activations)  # fmt: skip
        moe.expert_pool = layer
        layers.append(layer)
    staging = None
    if options.staging_experts >= 2 and any(p.num_cold for p in layers):
        first = next(p for p in layers if p.num_cold)  # every layer has the same format
        rows = empty_rows(tuple(t[0] for t in first.host), options.staging_experts, device)
        fmt, scales = first.weights.format, rows[2:] if len(rows) > 2 else (None, None)
        staging = ExpertWeights(rows[0], rows[1], format=fmt, w13_scale=scales[0],
                                w2_scale=scales[1])  # fmt: skip
    pool = ExpertPool(tuple(layers), counters, staging)
    logger.info("expert pool: %d layers, %.2f GiB on the device", len(layers),
                pool.device_bytes / (1 << 30))  # fmt: skip
    return pool
