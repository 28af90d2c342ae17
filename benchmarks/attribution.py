"""Where a step's GPU time goes: its kernels grouped by component (torch.profiler, CUPTI).

`attribute(step, device)` runs `step()` a few times under the profiler and returns the mean
kernel time per step of each component, the sum of all kernels, the step's wall time and the
rest (launch gaps and host work the GPU waits for: what CUDA graphs take away). Kernels are
named by their Triton function (`kernels/`) or by the library (cuBLAS GEMMs for the dense
projections, torch elementwise ops for the glue).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Callable

import torch

COMPONENTS = (  # first match wins: "_moe_combine_kernel" also contains "_combine_kernel"
    ("moe_experts", ("_w13_kernel", "_w2_kernel", "_moe_combine_kernel", "_experts_dequant")),
    ("attention", ("_attn_kernel", "_combine_kernel")),
    ("indexer", ("_logits_kernel", "_topk_kernel", "_select_all_kernel")),
    ("compressor", ("_compress_kernel", "_save_kernel")),
    ("kv_store", ("_store_kernel", "_gather_kernel")),
    ("router", ("_route_kernel", "_hash_route_kernel")),
    ("mhc", ("_hc_pre_kernel", "_hc_finish_kernel", "_hc_post_kernel")),
    ("norm_rope", ("_norm_rope_kernel",)),
    ("metadata", ("_range_slots_kernel", "_token_to_req_kernel", "_c4_topk_slots_kernel")),
    (
        "dense_gemm",
        (
            "gemm",
            "gemv",
            "cutlass",
            "xmma",
            "nvjet",
            "splitk",
            "sm90_",
            "_fp8_linear",
            "_fp8_dequant",
        ),
    ),
    ("sort_scan", ("sort", "scan", "radix", "bincount", "scatter", "searchsorted")),
)


def component_of(kernel_name: str) -> str:
    low = kernel_name.lower()
    for name, keys in COMPONENTS:
        if any(k.lower() in low for k in keys):
            return name
    return "elementwise_other"


def _kernel_us(event) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total", "device_time_total"):
        value = getattr(event, attr, None)
        if value:
            return float(value)
    return 0.0


def attribute(
    step: Callable[[], object], device: torch.device, repeats: int = 10, top: int = 12
) -> dict:
    """-> {"components_us": {name: us per step}, "kernels_us", "wall_us", "gaps_us",
    "top_kernels": [(name, us per step)], the `top` longest}; {} when the device is not CUDA."""
    if device.type != "cuda":
        return {}
    prof = _profiled(step, device, repeats, mark=False)
    by_kernel: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if str(getattr(event, "device_type", "")).endswith("CUDA"):
            by_kernel[event.name] += _kernel_us(event) / repeats
    components: dict[str, float] = defaultdict(float)
    for name, us in by_kernel.items():
        components[component_of(name)] += us
    walls = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
        walls.append((time.perf_counter() - start) * 1e6)
    wall = sorted(walls)[len(walls) // 2]
    kernels = sum(components.values())
    longest = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]
    return {
        "components_us": {k: round(v, 1) for k, v in sorted(components.items())},
        "kernels_us": round(kernels, 1),
        "wall_us": round(wall, 1),
        "gaps_us": round(wall - kernels, 1),
        "top_kernels": [(name[:80], round(us, 1)) for name, us in longest],
    }


# host calls that block until the GPU catches up (cudaMemcpy without Async is synchronous;
# torch's .item()/.tolist() are cudaMemcpyAsync + cudaStreamSynchronize); cu*: the driver API
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize")  # fmt: skip
STEP_MARK = "attribution_step"  # record_function around each step: its syncs, not ours


def count_events(events, repeats: int) -> dict:
    """Per step, from profiler events: GPU kernels launched, host syncs inside a STEP_MARK
    range (by call; CUPTI may name a call with its version, cudaMemcpy_v3020; without marks,
    every sync), device-to-host copies. Split from `launches_and_syncs` so the CPU
    tests can feed it events."""
    marks = [e.time_range for e in events
             if e.name == STEP_MARK and str(e.device_type).endswith("CPU")]  # fmt: skip
    syncs: dict[str, float] = defaultdict(float)
    kernels = dtoh = 0
    for e in events:
        if str(e.device_type).endswith("CUDA"):
            if e.name.startswith("Memcpy DtoH"):
                dtoh += 1
            elif not e.name.startswith(("Memcpy", "Memset")) and e.name != STEP_MARK:
                kernels += 1
        elif (call := re.sub(r"_v\d+$", "", e.name)) in SYNC_CALLS and (
            not marks or any(m.start <= e.time_range.start <= m.end for m in marks)
        ):
            syncs[call] += 1 / repeats
    return {"launches": round(kernels / repeats, 1),
            "host_syncs": round(sum(syncs.values()), 1),
            "dtoh_copies": round(dtoh / repeats, 1),
            "sync_calls": {k: round(v, 1) for k, v in sorted(syncs.items())}}  # fmt: skip


def gap_timeline(events, repeats: int, top: int = 8, min_gap_us: float = 5.0) -> dict:
    """Where the GPU idles inside each STEP_MARK range (us, mean per step): `lead_us` from the
    mark's start on the host to the step's first GPU op (host work before anything runs, e.g.
    tables built on the host), `between_us` idle time between the step's GPU ops (launch
    overhead the GPU outran, mid-step host work), `tail_us` from its last op to the mark's
    end; `gaps_over_min` the gaps of at least `min_gap_us` a step, and `top_gaps` the `top`
    (op before, op after) transitions with the most idle time a step. Profiler CPU and GPU
    timestamps share one clock (Kineto aligns them); streams overlap, so a gap is measured
    from the latest end seen so far."""
    marks = sorted((e.time_range for e in events
                    if e.name == STEP_MARK and str(e.device_type).endswith("CPU")),
                   key=lambda r: r.start)  # fmt: skip
    ops = sorted((e for e in events
                  if str(e.device_type).endswith("CUDA") and e.name != STEP_MARK),
                 key=lambda e: e.time_range.start)  # fmt: skip
    lead = between = tail = 0.0
    count = 0
    by_pair: dict[tuple[str, str], float] = defaultdict(float)
    for mark in marks:
        mine = [e for e in ops if mark.start <= e.time_range.start <= mark.end]
        if not mine:
            continue
        lead += mine[0].time_range.start - mark.start
        end, before = mine[0].time_range.end, mine[0].name
        for e in mine[1:]:
            gap = e.time_range.start - end
            if gap > 0:
                between += gap
                by_pair[(before[:60], e.name[:60])] += gap
                count += gap >= min_gap_us
            if e.time_range.end >= end:
                end, before = e.time_range.end, e.name
        tail += max(mark.end - end, 0.0)
    n = max(repeats, 1)
    worst = sorted(by_pair.items(), key=lambda kv: -kv[1])[:top]
    return {"lead_us": round(lead / n, 1), "between_us": round(between / n, 1),
            "tail_us": round(tail / n, 1), "gaps_over_min": round(count / n, 1),
            "top_gaps": [(a, b, round(us / n, 1)) for (a, b), us in worst]}  # fmt: skip


def launches_and_syncs(step: Callable[[], object], device: torch.device, repeats: int = 3) -> dict:
    """-> {"launches", "host_syncs", "dtoh_copies", "sync_calls": {call: per step},
    "gap_timeline": `gap_timeline`'s dict} of `step()` (count_events); {} when the device is
    not CUDA. A profile of its own: the closing synchronize lies outside every STEP_MARK
    range, so it is not counted."""
    if device.type != "cuda":
        return {}
    events = _profiled(step, device, repeats, mark=True).events()
    return {**count_events(events, repeats), "gap_timeline": gap_timeline(events, repeats)}


def _profiled(step: Callable[[], object], device: torch.device, repeats: int, mark: bool):
    """A torch.profiler (CPU + CUDA) of `repeats` calls of `step()` after one unprofiled
    call, each inside a STEP_MARK range when `mark`."""
    from contextlib import nullcontext

    from torch.profiler import ProfilerActivity, profile, record_function

    step()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            with record_function(STEP_MARK) if mark else nullcontext():
                step()
        torch.cuda.synchronize(device)
    return prof
