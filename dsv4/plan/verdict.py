"""The verdict of a memory plan and the message that explains it, with the numbers.

Offloading K routed experts per MoE layer to pinned host memory saves `K - slots` experts of
device memory per layer: the `slots` device cache slots per layer (through which the selected
cold experts are fetched) cost memory too. So the smallest K that fits is
    K = slots + ceil(deficit / (num_moe_layers * expert_bytes)),
where the deficit is first lowered by the experts of the idle MTP layer (loaded, never run
without speculative decoding), which any offload moves to host memory whole. K must not exceed
the experts a GPU holds per layer, nor the host copies of all the GPUs of a node (host memory
is per node) its pinned budget. An offload whose fetch estimate exceeds the TPOT SLO fits in
memory but not in time: its own verdict says so.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsv4.plan.planner import MemoryPlan

FITS, FITS_WITH_OFFLOAD, DOES_NOT_FIT = "fits", "fits_with_offload", "does_not_fit"
FITS_WITH_OFFLOAD_OVER_SLO = "fits_with_offload_over_tpot_slo"  # memory fits; decode too slow
_GIB = 1024**3


def gib(nbytes: float) -> str:
    return f"{nbytes / _GIB:.2f} GiB"


def decide(plan: MemoryPlan) -> MemoryPlan:
    """`plan` without offload -> the same plan with its verdict, K and message filled in."""
    if plan.needed_bytes <= plan.usable_bytes:
        return replace(plan, verdict=FITS, message=_fits_message(plan))
    req = plan.request
    layers, per_expert, e = plan.num_moe_layers, plan.expert_bytes, plan.experts_per_layer
    # offloading adds the prefill staging buffer (`PlanRequest.staging_experts`) and moves the
    # idle layers' experts to host memory (less the slots the reference forward keeps them)
    slots = min(req.cache_slots, e)
    idle_kept = slots if req.idle_layer_slots else 0
    idle_moved = plan.idle_moe_layers * (e - idle_kept) * per_expert
    deficit = plan.needed_bytes - plan.usable_bytes + req.staging_experts * per_expert - idle_moved
    k = slots + math.ceil(max(deficit, 0) / (layers * per_expert))
    if k > e:  # even all-offloaded does not fit: report that extreme
        k = e
        slots = min(slots, k)
    # the served layers' cold experts and the idle layers' moved ones (the worker's own check,
    # `dsv4.worker.offload.expert_offload`, counts both the same way)
    host = layers * k * per_expert + idle_moved
    attempt = replace(plan, offloaded_per_layer=k, cache_slots=slots, host_bytes=host)
    device_ok = attempt.needed_bytes <= attempt.usable_bytes
    host_ok = attempt.node_host_bytes <= attempt.host_usable_bytes
    if device_ok and host_ok:
        slow = attempt.fetch_ms_per_token > req.tpot_slo_ms
        verdict = FITS_WITH_OFFLOAD_OVER_SLO if slow else FITS_WITH_OFFLOAD
        return replace(attempt, verdict=verdict, message=_offload_message(attempt, slow))
    return replace(attempt, verdict=DOES_NOT_FIT, message=_no_fit_message(plan, attempt, device_ok))


def _where(plan: MemoryPlan) -> str:
    req = plan.request
    return (
        f"{plan.request.model.num_hidden_layers}-layer model on {req.num_gpus} x "
        f"{req.gpu_mem_gib:g} GiB (tp={req.tp}, ep={req.ep})"
    )


def _breakdown(plan: MemoryPlan) -> str:
    req = plan.request
    extras = ", ".join(f"{b.name} {gib(b.nbytes)}" for b in plan.buffers)
    non_expert = plan.weight_bytes - plan.routed_expert_bytes
    idle = f" + unused MTP layer {gib(plan.idle_device_bytes)}" if plan.idle_moe_layers else ""
    return (
        f"per GPU: weights {gib(non_expert)} + routed experts {gib(plan.device_expert_bytes)}"
        f" + KV {gib(plan.kv.total_bytes)} ({req.max_num_seqs} seqs x {req.max_model_len} tokens"
        f" x {gib(plan.kv.bytes_per_request)}){idle} + {extras}"
        f" = {gib(plan.needed_bytes)} of {gib(plan.usable_bytes)} usable"
        f" ({req.gpu_mem_gib:g} GiB x {req.memory_fraction:g} - {req.runtime_reserve_gib:g} GiB"
        " reserve)"
    )


def max_seqs_that_fit(plan: MemoryPlan) -> int:
    """Full-length sequences whose KV fits next to everything else of `plan`."""
    room = plan.usable_bytes - (plan.needed_bytes - plan.kv.total_bytes)
    return max(0, room // plan.kv.bytes_per_request)


def max_len_that_fits(plan: MemoryPlan) -> int:
    """Tokens of ONE sequence whose KV fits next to everything else of `plan` (0: none)."""
    room = plan.usable_bytes - (plan.needed_bytes - plan.kv.total_bytes)
    kv = plan.kv
    blocks = room // kv.block_stride_bytes - kv.num_ring_blocks
    return max(0, blocks * kv.block_size)


def _fits_message(plan: MemoryPlan) -> str:
    spare = max_seqs_that_fit(plan) - plan.request.max_num_seqs
    return f"fits: {_where(plan)}; {_breakdown(plan)}; room for {spare} more full-length seqs"


def _offload_message(plan: MemoryPlan, slow: bool) -> str:
    req = plan.request
    e, k = plan.experts_per_layer, plan.offloaded_per_layer
    fetch = (
        f"uniform-routing fetch <= {plan.fetch_ms_per_token:.1f} ms per decode token at"
        f" {req.h2d_gb_per_s:g} GB/s"
    )
    head = f"fits with {k} of {e} experts per layer offloaded to pinned host memory"
    if slow:
        head = (
            f"OVER THE TPOT SLO: memory fits with {k} of {e} experts per layer offloaded, but"
            f" fetching them takes up to {plan.fetch_ms_per_token:.1f} ms per decode token, over"
            f" --tpot-slo-ms {req.tpot_slo_ms:g} (fixes: more GPUs, fewer --max-num-seqs or a"
            " shorter --max-model-len, so fewer experts are offloaded)"
        )
    return (
        f"{head}: {_where(plan)}; {_breakdown(plan)}; host holds {_host(plan)};"
        f" device keeps {e - k} resident + {plan.cache_slots} cache slots per layer; {fetch}"
    )


def _host(plan: MemoryPlan) -> str:
    n = plan.request.gpus_per_node
    return (
        f"{n} GPUs x {gib(plan.host_bytes)} = {gib(plan.node_host_bytes)} of"
        f" {gib(plan.host_usable_bytes)} pinnable per node"
    )


def _no_fit_message(plan: MemoryPlan, attempt: MemoryPlan, device_ok: bool) -> str:
    req = plan.request
    short = plan.needed_bytes - plan.usable_bytes
    lines = [f"does not fit: {_where(plan)}; {_breakdown(plan)}; short by {gib(short)} per GPU."]
    k, e = attempt.offloaded_per_layer, attempt.experts_per_layer
    if device_ok:
        lines.append(
            f"Offloading {k} of {e} experts per layer would fit the device but needs"
            f" {req.gpus_per_node} GPUs x {gib(attempt.host_bytes)} ="
            f" {gib(attempt.node_host_bytes)} of pinned host memory per node; --host-mem"
            f" {req.host_mem_gib:g} allows {gib(attempt.host_usable_bytes)}"
            f" (x {req.host_mem_fraction:g}): give --host-mem >="
            f" {math.ceil(attempt.node_host_bytes / req.host_mem_fraction / _GIB)} per node."
        )
    else:
        lines.append(
            f"Even with all {e} experts per layer offloaded the rest needs"
            f" {gib(attempt.needed_bytes)} per GPU, short by"
            f" {gib(attempt.needed_bytes - attempt.usable_bytes)}."
        )
    best = attempt if attempt.node_host_bytes <= attempt.host_usable_bytes else plan
    fit_seqs = max_seqs_that_fit(best)
    if fit_seqs:
        fix = f"--max-num-seqs {fit_seqs} (full-length sequences whose KV fits)"
    elif max_len_that_fits(best):
        fix = f"--max-model-len {max_len_that_fits(best)} (for one sequence)"
    else:
        fix = "fewer --max-num-batched-tokens (smaller workspaces); no KV fits as planned"
    lines.append(f"Fixes: more GPUs, or {fix}.")
    return " ".join(lines)
