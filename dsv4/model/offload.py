"""Expert offload: routed experts that do not fit the device live in (pinned) host memory.

Per MoE layer an `OffloadedExperts` store (the `ExpertStore` of `dsv4.model.moe`) holds
- `resident` experts on the device for good (the hot set; `dsv4.plan` says how many fit),
- the cold experts in host memory (pinned when CUDA is available), and
- `cache_slots` device slots: an LRU or LFU cache of cold experts, filled on demand.

`prepare(ids)` (once per forward) copies every selected cold expert that is not cached into a
free slot on a side stream, so the copies overlap the compute of the experts before it in the
dispatch order; `expert(e)` makes the compute stream wait for e's copy only. With fewer slots
than misses, later misses reuse slots of experts already computed this step. A miss routed to
only a handful of tokens can instead run on the CPU from the host copy when the cost model
says that is faster than the copy (`OffloadPolicy`, off by default: on a GPU host the CPU
rounds differently). Dispatch order and math are those of the resident path, so outputs are
identical (bit for bit) with and without offload.

Each expert is one flat byte blob (one copy per fetch): dense w1/w2/w3 in the model dtype,
or MXFP4 (int8 e2m1 pairs + UE8M0 scales per 32 values) dequantised at use.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from dsv4.errors import ConfigError
from dsv4.model.moe import MoE, mxfp4_layout_
from dsv4.ops.moe import swiglu
from dsv4.ops.quant import E2M1_MAGNITUDES, MXFP4_BLOCK, mxfp4_quantize

ALIGN_BYTES = 256  # part offsets inside a blob: keep every view as aligned as a fresh tensor
Part = tuple[str, tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class ExpertFormat:
    """Byte layout of one expert blob: named parts at aligned offsets."""

    parts: tuple[Part, ...]
    compute_dtype: torch.dtype
    is_mxfp4: bool

    @classmethod
    def dense(cls, dim: int, inter: int, dtype: torch.dtype) -> ExpertFormat:
        # w1 then w3: a layer's cold blobs double as the expert pool's stacked w13 host rows
        # (`dsv4.runner.paged.pool_storage.adopt_host_rows`)
        parts = (
            ("w1", (inter, dim), dtype),
            ("w3", (inter, dim), dtype),
            ("w2", (dim, inter), dtype),
        )
        return cls(parts, dtype, False)

    @classmethod
    def mxfp4(cls, dim: int, inter: int, compute_dtype: torch.dtype) -> ExpertFormat:
        # codes w1, w3, w2, then their scales in the same order: w1 | w3 and their scales sit
        # side by side, as the expert pool's stacked w13 rows (see `dense`)
        shapes = (("w1", (inter, dim)), ("w3", (inter, dim)), ("w2", (dim, inter)))
        codes = [(name, (rows, cols // 2), torch.int8) for name, (rows, cols) in shapes]
        scales = [(f"{name}_scale", (rows, cols // MXFP4_BLOCK), torch.float8_e8m0fnu)
                  for name, (rows, cols) in shapes]  # fmt: skip
        return cls((*codes, *scales), compute_dtype, True)

    @property
    def offsets(self) -> tuple[int, ...]:
        out, offset = [], 0
        for _, shape, dtype in self.parts:
            out.append(offset)
            size = math.prod(shape) * dtype.itemsize
            offset += -(-size // ALIGN_BYTES) * ALIGN_BYTES
        return (*out, offset)

    @property
    def nbytes(self) -> int:
        return self.offsets[-1]

    def views(self, blob: torch.Tensor) -> dict[str, torch.Tensor]:
        """blob [nbytes] uint8 -> the parts, as views (no copy)."""
        offs = self.offsets
        return {
            name: blob[offs[i] : offs[i] + math.prod(shape) * dtype.itemsize]
            .view(dtype)
            .view(shape)
            for i, (name, shape, dtype) in enumerate(self.parts)
        }

    def pack(self, tensors: dict[str, torch.Tensor], blob: torch.Tensor) -> None:
        for name, view in self.views(blob).items():
            view.copy_(tensors[name])

    def weights(self, blob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w2, w3) in the compute dtype; MXFP4 parts are dequantised here."""
        v = self.views(blob)
        if not self.is_mxfp4:
            return v["w1"], v["w2"], v["w3"]
        deq = [
            mxfp4_dequantize_lut(v[n], v[f"{n}_scale"], self.compute_dtype)
            for n in ("w1", "w2", "w3")
        ]
        return deq[0], deq[1], deq[2]


_LUT_CACHE: dict[torch.device, torch.Tensor] = {}


def mxfp4_dequantize_lut(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """`dsv4.ops.quant.mxfp4_dequantize` with one 256-entry table lookup per byte (same
    values: every product of an e2m1 code and a power of two is exact)."""
    lut = _LUT_CACHE.get(packed.device)
    if lut is None:
        mags = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES))
        byte = torch.arange(256)
        lut = torch.stack((mags[byte & 15], mags[byte >> 4]), dim=-1).to(packed.device)
        _LUT_CACHE[packed.device] = lut  # [256, 2] fp32: (low nibble, high nibble)
    rows, half = packed.shape
    values = lut[packed.view(torch.uint8).to(torch.int32)]  # [rows, half, 2]
    values = values.view(rows, half * 2 // MXFP4_BLOCK, MXFP4_BLOCK) * scale.float()[..., None]
    return values.view(rows, half * 2).to(dtype)


@dataclass(frozen=True)
class OffloadPolicy:
    eviction: str = "lru"  # "lru" | "lfu" (least selected so far; ties: least recent)
    cpu_compute_max_tokens: int = 0  # misses routed to at most this many tokens may run on CPU
    cpu_gflops: float = 50.0  # CPU matmul throughput for the cost model
    h2d_gb_per_s: float = 25.0  # pinned host -> device copy bandwidth for the cost model


@dataclass
class ExpertStats:
    """Counters of one store (or a sum of stores): expert uses by where the weights were."""

    resident_hits: int = 0
    cache_hits: int = 0
    misses: int = 0  # fetched from host into a slot
    cpu_computes: int = 0  # computed on the CPU from the host copy
    bytes_fetched: int = 0
    prefetches: int = 0  # copied ahead of their layer (the paged pool's pre-gating only)

    @property
    def uses(self) -> int:
        return self.resident_hits + self.cache_hits + self.misses + self.cpu_computes

    @property
    def hit_rate(self) -> float:
        """Expert uses served from device memory (resident or cached) without a fetch."""
        return (self.resident_hits + self.cache_hits) / self.uses if self.uses else 0.0

    @property
    def cache_hit_rate(self) -> float:
        """Of the uses of cold (offloaded) experts, those the device cache served."""
        cold = self.cache_hits + self.misses + self.cpu_computes
        return self.cache_hits / cold if cold else 0.0

    def add(self, other: ExpertStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class _Slots:
    """The device cache: `blobs` [num_slots, nbytes] and who is in which slot."""

    blobs: torch.Tensor
    expert: list[int | None]
    last_used: list[int]
    ready: list[torch.cuda.Event | None]
    filled_step: list[int]
    where: dict[int, int] = field(default_factory=dict)  # expert -> slot


class OffloadedExperts:
    """One MoE layer's routed experts: resident + host copies + a device cache (`ExpertStore`).

    `resident` [R, nbytes] device blobs of experts `resident_ids`; `host` {expert: blob} for
    every other expert. Not thread-safe: called from the model's forward only.
    """

    def __init__(
        self,
        fmt: ExpertFormat,
        resident_ids: list[int],
        resident: torch.Tensor,
        host: dict[int, torch.Tensor],
        cache_slots: int,
        limit: float | None,
        device: torch.device,
        policy: OffloadPolicy = OffloadPolicy(),
    ) -> None:
        if host and cache_slots < 1:
            raise ValueError("offloaded experts need at least one device cache slot")
        self.fmt, self.limit, self.device, self.policy = fmt, limit, device, policy
        self.resident = resident
        self.resident_row = {e: i for i, e in enumerate(resident_ids)}
        self.host = host
        n = cache_slots if host else 0
        self.slots = _Slots(
            torch.empty(n, fmt.nbytes, dtype=torch.uint8, device=device),
            [None] * n, [0] * n, [None] * n, [-1] * n,
        )  # fmt: skip
        self.stats = ExpertStats()
        self.selections: dict[int, int] = {}  # expert -> forwards that selected it (LFU)
        self.is_cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self._step = 0
        self._selected: set[int] = set()  # experts of this step
        self._on_cpu: set[int] = set()
        self._done: set[int] = set()  # experts already computed this step

    # ---- ExpertStore ---------------------------------------------------------------------
    def prepare(self, ids: torch.Tensor) -> None:
        unique, counts = ids.unique(return_counts=True)
        selected = dict(zip(unique.tolist(), counts.tolist()))
        self._step += 1
        self._selected, self._on_cpu, self._done = set(selected), set(), set()
        for e in selected:
            self.selections[e] = self.selections.get(e, 0) + 1
        misses = [e for e in selected if e in self.host and e not in self.slots.where]
        for e in misses:
            if self._prefer_cpu(selected[e]):
                self._on_cpu.add(e)
        if self.is_cuda and misses:
            # Slots we overwrite may still be read by the previous step's kernels.
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        protected = set(selected)
        for e in misses:
            if e in self._on_cpu:
                continue
            slot = self._victim(protected)
            if slot is None:
                break  # more misses than slots: the rest are fetched as slots free up
            self._fill(slot, e)

    def expert(self, e: int, num_tokens: int) -> Callable[[torch.Tensor], torch.Tensor]:
        self._done.add(e)
        if e in self.resident_row:
            self.stats.resident_hits += 1
            return self._runner(self.resident[self.resident_row[e]])
        if e in self._on_cpu:
            self.stats.cpu_computes += 1
            return self._cpu_runner(self.host[e])
        slot = self.slots.where.get(e)
        if slot is None:  # not fetched in prepare: reuse the slot of an expert already done
            slot = self._victim(protected=self._selected - self._done)
            if slot is None:  # every slot holds a later expert of this step: evict one anyway
                slot = min(range(len(self.slots.expert)), key=self.slots.last_used.__getitem__)
            if self.is_cuda:
                self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            self._fill(slot, e)
        if self.slots.filled_step[slot] == self._step:
            self.stats.misses += 1
        else:
            self.stats.cache_hits += 1
        self.slots.last_used[slot] = self._step
        ready = self.slots.ready[slot]
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        return self._runner(self.slots.blobs[slot])

    def parts(self, e: int) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """Expert e's w1, w2, w3 as (weight, scale or None) views of its blob (on the device
        when resident, else the host copy): what a loader fills (`dsv4.model.offload_load`)."""
        blob = self.resident[self.resident_row[e]] if e in self.resident_row else self.host[e]
        views = self.fmt.views(blob)
        return {n: (views[n], views.get(f"{n}_scale")) for n in ("w1", "w2", "w3")}

    # ---- internals -------------------------------------------------------------------------
    def _runner(self, blob: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(u: torch.Tensor) -> torch.Tensor:
            return swiglu(u, *self.fmt.weights(blob), self.limit)

        return run

    def _cpu_runner(self, blob: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(u: torch.Tensor) -> torch.Tensor:
            return swiglu(u.cpu(), *self.fmt.weights(blob), self.limit).to(u.device)

        return run

    def _prefer_cpu(self, num_tokens: int) -> bool:
        policy = self.policy
        if num_tokens > policy.cpu_compute_max_tokens:
            return False
        (_, (inter, dim), _) = self.fmt.parts[0]
        flops = 2 * 3 * dim * inter * num_tokens
        cpu_s = flops / (policy.cpu_gflops * 1e9)
        return cpu_s < self.fmt.nbytes / (policy.h2d_gb_per_s * 1e9)

    def _victim(self, protected: set[int]) -> int | None:
        """A slot to overwrite: an empty one, else the LRU / LFU expert not in `protected`."""
        slots = self.slots
        free = [i for i, x in enumerate(slots.expert) if x is None]
        if free:
            return free[0]
        candidates = [i for i, x in enumerate(slots.expert) if x not in protected]
        if not candidates:
            return None
        if self.policy.eviction == "lfu":
            return min(
                candidates, key=lambda i: (self.selections[slots.expert[i]], slots.last_used[i])
            )
        return min(candidates, key=slots.last_used.__getitem__)

    def _fill(self, slot: int, e: int) -> None:
        slots = self.slots
        old = slots.expert[slot]
        if old is not None:
            del slots.where[old]
        slots.expert[slot], slots.where[e] = e, slot
        slots.filled_step[slot], slots.last_used[slot] = self._step, self._step
        self.stats.bytes_fetched += self.fmt.nbytes
        if not self.is_cuda:
            slots.blobs[slot].copy_(self.host[e])
            return
        with torch.cuda.stream(self.copy_stream):
            slots.blobs[slot].copy_(self.host[e], non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.copy_stream)
        slots.ready[slot] = ready


# ---- building stores ---------------------------------------------------------------------
def expert_blob(
    fmt: ExpertFormat, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """Pack one expert's weights into a [nbytes] uint8 blob on `device` (MXFP4: quantised;
    exact for weights that came from an MXFP4 checkpoint)."""
    tensors = {"w1": w1, "w2": w2, "w3": w3}
    if fmt.is_mxfp4:
        for name, w in list(tensors.items()):
            tensors[name], tensors[f"{name}_scale"] = mxfp4_quantize(w.float())
    blob = torch.empty(fmt.nbytes, dtype=torch.uint8, device=device)
    fmt.pack({k: v.to(device) for k, v in tensors.items()}, blob)
    return blob


def host_copy(blob: torch.Tensor) -> torch.Tensor:
    """A host copy of `blob`, pinned when CUDA is available (async copies need pinned memory)."""
    cpu = blob.to("cpu", copy=True)
    return cpu.pin_memory() if torch.cuda.is_available() else cpu


def offload_moe(
    moe: MoE,
    num_offloaded: int,
    cache_slots: int,
    *,
    fmt: str = "dense",
    device: torch.device | str | None = None,
    policy: OffloadPolicy = OffloadPolicy(),
    hot: list[int] | None = None,
) -> OffloadedExperts:
    """Move `moe`'s routed experts into a store: the first `E - num_offloaded` of `hot` (most
    used first; default 0..E-1) stay on the device, the rest go to host memory. The `experts`
    modules (or the MXFP4 stacked storage of `features.expert_weights=checkpoint`, packed as
    stored) are dropped (their memory freed); `moe.expert_store` serves the forward."""
    # the blobs hold MXFP4 as stored: a paged forward's re-packing is undone in place first
    cfg, stacked = moe.cfg, mxfp4_layout_(moe, "stored")
    native = stacked is not None and stacked.is_quantized
    if native and (stacked.format, fmt) != ("mxfp4", "mxfp4"):
        raise ConfigError("features.expert_weights", "checkpoint",
                          f"experts held as {stacked.format} offload only as MXFP4 blobs (asked: "
                          f"{fmt}): load them as bf16 to offload them {fmt}")  # fmt: skip
    num = cfg.n_routed_experts
    if not 0 <= num_offloaded <= num:
        raise ValueError(f"num_offloaded must be in [0, {num}], got {num_offloaded}")
    like = moe.gate.weight if native else moe.experts[0].w1.weight  # the compute dtype
    dtype, device = like.dtype, torch.device(device or like.device)
    inter, dim = cfg.moe_intermediate_size, cfg.hidden_size
    layout = (
        ExpertFormat.mxfp4(dim, inter, dtype)
        if fmt == "mxfp4"
        else ExpertFormat.dense(dim, inter, dtype)
    )
    order = list(hot) if hot is not None else list(range(num))
    resident_ids = sorted(order[: num - num_offloaded])
    resident = torch.empty(len(resident_ids), layout.nbytes, dtype=torch.uint8, device=device)
    host: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for e in range(num):
            if native:
                blob = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
                parts = stacked.parts(e)
                layout.pack({**{n: w for n, (w, _) in parts.items()},
                             **{f"{n}_scale": s for n, (_, s) in parts.items()}}, blob)  # fmt: skip
            else:
                ex = moe.experts[e]
                blob = expert_blob(layout, ex.w1.weight, ex.w2.weight, ex.w3.weight, device)
            if e in resident_ids:
                resident[resident_ids.index(e)].copy_(blob)
            else:
                host[e] = host_copy(blob)
    store = OffloadedExperts(
        layout, resident_ids, resident, host, cache_slots, cfg.swiglu_limit, device, policy
    )
    moe.experts = nn.ModuleList()
    moe.expert_store = store
    if stacked is not None and stacked.w13_all is not None:
        for module in (moe.shared_experts.w1, moe.shared_experts.w2, moe.shared_experts.w3):
            # the shared expert lived in the routed storage's last slot: give it its own, so
            # that storage is freed with the dropped experts
            module.weight = nn.Parameter(module.weight.detach().clone(), requires_grad=False)
    moe.stacked_experts = None
    return store


def offload_model(
    model: nn.Module, num_offloaded: int, cache_slots: int, **kwargs
) -> list[OffloadedExperts]:
    """`offload_moe` on every MoE layer of `model` (the MTP layer's too)."""
    return [
        offload_moe(m, num_offloaded, cache_slots, **kwargs)
        for m in model.modules()
        if isinstance(m, MoE)
    ]


def offload_stats(model: nn.Module) -> ExpertStats:
    """The counters of every store of `model`, summed."""
    total = ExpertStats()
    for m in model.modules():
        store = getattr(m, "expert_store", None)
        if isinstance(store, OffloadedExperts):
            total.add(store.stats)
    return total
