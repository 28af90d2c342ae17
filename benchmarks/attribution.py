"""Where a step's GPU time goes: its kernels grouped by component (torch.profiler, CUPTI).

`attribute(step, device)` runs `step()` a few times under the profiler and returns the mean
kernel time per step of each component, the sum of all kernels, the step's wall time and the
rest (launch gaps and host work the GPU waits for: what CUDA graphs take away). Kernels are
named by their Triton function (`kernels/`) or by the library (cuBLAS GEMMs for the dense
projections, torch elementwise ops for the glue).
"""

from __future__ import annotations

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


def attribute(step: Callable[[], object], device: torch.device, repeats: int = 10) -> dict:
    """-> {"components_us": {name: us per step}, "kernels_us", "wall_us", "gaps_us",
    "top_kernels": [(name, us per step)]}; {} when the device is not CUDA."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize(device)
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
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:12]
    return {
        "components_us": {k: round(v, 1) for k, v in sorted(components.items())},
        "kernels_us": round(kernels, 1),
        "wall_us": round(wall, 1),
        "gaps_us": round(wall - kernels, 1),
        "top_kernels": [(name[:80], round(us, 1)) for name, us in top],
    }
