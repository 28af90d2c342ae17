"""Routed experts split at load time: resident experts straight to the device, cold experts
straight into (pinned) host memory, so neither the whole expert set on the device nor a dense
host copy of the model ever exists (`dsv4.model.offload` moves a model loaded whole instead).

`offload_experts_empty_(model, offload, served_format, device)` replaces every MoE layer's
routed experts (layers 0..L-1, then the MTP layer) by an `OffloadedExperts` store whose blobs
are allocated empty; the loaders (`dsv4.model.tiny.random_model`, `dsv4.model.weights.
load_model`) then fill each expert through `store.parts(e)`, as they fill the stacked storage.
"""

from __future__ import annotations

import mmap
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from dsv4.errors import ConfigError, ResourceExhausted
from dsv4.model.moe import MoE
from dsv4.model.offload import ExpertFormat, OffloadedExperts


@dataclass(frozen=True)
class ExpertOffload:
    """How many routed experts of each MoE layer live in host memory, and which.

    `hot[i]`: MoE layer i's experts, most used first (layers 0..L-1, then the MTP layer); the
    first `E - num_offloaded` stay on the device. A missing or partial order is completed with
    the remaining experts in index order."""

    num_offloaded: int  # K cold experts per MoE layer
    cache_slots: int  # device slots per layer through which cold experts are fetched
    hot: tuple[tuple[int, ...], ...] = ()
    # MoE layers the plan counted; later ones (the MTP layer when speculative decoding is off,
    # so it never runs) keep every expert in host memory. 0: every layer has K.
    planned_layers: int = 0

    def offloaded(self, layer_index: int, num_experts: int) -> int:
        """Cold experts of MoE layer `layer_index`."""
        unplanned = self.planned_layers and layer_index >= self.planned_layers
        return num_experts if unplanned else self.num_offloaded

    def order(self, layer_index: int, num_experts: int) -> list[int]:
        """MoE layer `layer_index`'s experts, most used first (completed in index order)."""
        given = self.hot[layer_index] if layer_index < len(self.hot) else ()
        return [*given, *(e for e in range(num_experts) if e not in set(given))]

    def resident_ids(self, layer_index: int, num_experts: int) -> list[int]:
        kept = num_experts - self.offloaded(layer_index, num_experts)
        return sorted(self.order(layer_index, num_experts)[:kept])


def expert_format(served_format: str, hidden: int, inter: int, dtype: torch.dtype) -> ExpertFormat:
    """The blob layout of an offloaded expert held as `served_format` ("bf16": dense in the
    model dtype, "mxfp4": as the checkpoint stores it); FP8 experts do not offload."""
    if served_format == "bf16":
        return ExpertFormat.dense(hidden, inter, dtype)
    if served_format == "mxfp4":
        return ExpertFormat.mxfp4(hidden, inter, dtype)
    raise ConfigError("model.host_memory_gib", "> 0", f"experts held as {served_format} do not "
                      "offload: serve them with --expert-weights bf16, or give 0")  # fmt: skip


def host_blobs(rows: int, nbytes: int, pin: bool, mapped: bool = False) -> torch.Tensor:
    """[rows, nbytes] uint8 in host memory, page-locked when `pin` (async copies need it);
    `mapped`: also mapped into the devices' address space (portable + mapped), so kernels read
    it through its device address (the paged forward's expert pool copies that way).

    Registered with cudaHostRegister rather than `pin_memory=True`: torch's pinned allocator
    rounds every allocation up to a power of two (a 0.8 GiB layer would pin 1 GiB). The memory
    is an anonymous mmap that the tensor holds through the buffer protocol, and the
    registration ends when that region is freed, i.e. after the last view of it: callers keep
    only views (rows, dtype views), and a finalizer on this tensor object would unregister the
    memory as soon as it went out of scope (it did: the pool's kernels then found the host
    rows unregistered, and the offload store's copies ran from pageable memory)."""
    if not (pin and rows * nbytes):
        return torch.empty(rows, nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, rows * nbytes)  # page-aligned, zero pages mapped on first touch
    blobs = torch.frombuffer(region, dtype=torch.uint8).view(rows, nbytes)
    cudart = torch.cuda.cudart()
    ptr = blobs.data_ptr()
    flags = 3 if mapped else 0  # cudaHostRegisterPortable | cudaHostRegisterMapped
    status = cudart.cudaHostRegister(ptr, blobs.numel(), flags)
    if int(status) != 0:  # e.g. the locked-memory limit (ulimit -l) is below the budget
        raise ResourceExhausted(f"cannot pin {blobs.numel() / (1 << 30):.2f} GiB of host "
                                f"memory for offloaded experts (cudaHostRegister: {status}): "
                                "raise the locked-memory limit (ulimit -l)")  # fmt: skip
    weakref.finalize(region, cudart.cudaHostUnregister, ptr)
    return blobs


def empty_offloaded_experts_(
    moe: MoE,
    fmt: ExpertFormat,
    resident_ids: list[int],
    cache_slots: int,
    device: torch.device,
) -> OffloadedExperts:
    """Give `moe` a store of empty blobs: `resident_ids` on `device` ([R, nbytes], one
    allocation), the others in host memory ([K, nbytes], one allocation); its routed expert
    modules (still on the meta device) are dropped. A loader fills `store.parts(e)`."""
    num = moe.cfg.n_routed_experts
    cold_ids = [e for e in range(num) if e not in set(resident_ids)]
    resident = torch.empty(len(resident_ids), fmt.nbytes, dtype=torch.uint8, device=device)
    cold = host_blobs(len(cold_ids), fmt.nbytes, pin=device.type == "cuda")
    host = {e: cold[i] for i, e in enumerate(cold_ids)}
    store = OffloadedExperts(
        fmt, resident_ids, resident, host, cache_slots, moe.cfg.swiglu_limit, device
    )
    moe.experts = nn.ModuleList()
    moe.stacked_experts = None
    moe.expert_store = store
    return store


def offload_experts_empty_(
    model: nn.Module,
    offload: ExpertOffload,
    served_format: str,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[OffloadedExperts]:
    """`empty_offloaded_experts_` on every MoE layer of `model` (built on the meta device, cast
    to `dtype`), with `offload`'s resident experts per layer."""
    device = torch.device(device)
    stores = []
    for i, moe in enumerate(m for m in model.modules() if isinstance(m, MoE)):
        cfg = moe.cfg
        fmt = expert_format(served_format, cfg.hidden_size, cfg.moe_intermediate_size, dtype)
        resident = offload.resident_ids(i, cfg.n_routed_experts)
        stores.append(empty_offloaded_experts_(moe, fmt, resident, offload.cache_slots, device))
    return stores
