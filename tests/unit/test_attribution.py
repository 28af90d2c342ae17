"""benchmarks/attribution.py: profiler kernel names -> the decode step's components."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "attribution.py"
_SPEC = importlib.util.spec_from_file_location("bench_attribution", _PATH)
attribution = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(attribution)


@pytest.mark.parametrize(
    "kernel,component",
    [
        ("_fp8_linear_kernel", "dense_gemm"),
        ("_fp8_gemv_kernel", "dense_gemm"),
        ("_fp8_dequant_kernel", "dense_gemm"),  # FP8 linears above 2 rows: dequantise + cuBLAS
        ("nvjet_tst_128x64_64x8_1x1_v_bz_coopB_TNT", "dense_gemm"),
        ("_w13_kernel", "moe_experts"),
        ("_experts_dequant_kernel", "moe_experts"),  # MXFP4 prefill: the experts' bf16 scratch
        ("_moe_combine_kernel", "moe_experts"),
        ("_combine_kernel", "attention"),
        ("void at::native::vectorized_elementwise_kernel<4>", "elementwise_other"),
    ],
)
def test_kernel_names_map_to_their_component(kernel, component):
    assert attribution.component_of(kernel) == component


def _event(name: str, device: str, start: float, end: float | None = None):
    from types import SimpleNamespace

    span = SimpleNamespace(start=start, end=start if end is None else end)
    return SimpleNamespace(name=name, device_type=f"DeviceType.{device}", time_range=span)


def test_count_events_counts_per_step_inside_the_step_marks():
    """Kernels and device-to-host copies per step; host syncs only inside a step's mark (the
    profile's own closing synchronize is not the step's), by call, version suffix dropped."""
    mark = attribution.STEP_MARK
    events = []
    for i in range(2):  # two steps of 3 kernels, one .item() (copy + stream sync) each
        t = 100.0 * i
        events += [_event(mark, "CPU", t, t + 50), _event(mark, "CUDA", t, t + 50)]
        events += [_event(f"_attn_kernel_{k}", "CUDA", t + k) for k in range(3)]
        events += [_event("Memcpy DtoH (Device -> Pageable)", "CUDA", t + 5),
                   _event("Memset (Device)", "CUDA", t + 6),
                   _event("cudaMemcpyAsync", "CPU", t + 7),
                   _event("cudaStreamSynchronize" + ("_v3020" if i else ""), "CPU", t + 8)]  # fmt: skip
    events.append(_event("cudaDeviceSynchronize", "CPU", 500.0))  # outside every step
    found = attribution.count_events(events, repeats=2)
    assert found == {"launches": 3.0, "host_syncs": 1.0, "dtoh_copies": 1.0,
                     "sync_calls": {"cudaStreamSynchronize": 1.0}}  # fmt: skip


def test_gap_timeline_splits_idle_time_into_lead_between_and_tail():
    """Per step: host time before the first GPU op, idle time between ops (from the latest end
    seen: overlapping streams are not gaps), after the last; the worst transitions by name."""
    mark = attribution.STEP_MARK
    events = []
    for i in range(2):
        t = 1000.0 * i
        events += [_event(mark, "CPU", t, t + 200), _event(mark, "CUDA", t + 30, t + 31)]
        events += [_event("host_built", "CUDA", t + 40, t + 50),  # lead 40
                   _event("_w13_kernel", "CUDA", t + 50, t + 100),
                   _event("side_stream", "CUDA", t + 60, t + 70),  # inside w13: no gap
                   _event("_attn_kernel", "CUDA", t + 120, t + 130),  # 20 after w13
                   _event("_w2_kernel", "CUDA", t + 133, t + 190)]  # 3, then tail 10  # fmt: skip
    events.append(_event("outside", "CUDA", 5000.0, 5010.0))  # in no step
    found = attribution.gap_timeline(events, repeats=2, top=1)
    assert found == {"lead_us": 40.0, "between_us": 23.0, "tail_us": 10.0, "gaps_over_min": 1.0,
                     "top_gaps": [("_w13_kernel", "_attn_kernel", 20.0)]}  # fmt: skip


def test_attribute_and_counts_are_empty_off_cuda():
    import torch

    cpu = torch.device("cpu")
    assert attribution.attribute(lambda: None, cpu, top=15) == {}
    assert attribution.launches_and_syncs(lambda: None, cpu) == {}
