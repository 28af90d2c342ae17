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
