"""Kernel tests run the Triton kernels on CPU under the interpreter when there is no GPU.

TRITON_INTERPRET must be set before `@triton.jit` runs, so this file sets it before any test
module imports `kernels`; if another test package imported `kernels` earlier without it, the
kernel modules are reloaded so their kernels are re-decorated for the interpreter.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    if "kernels.routing" in sys.modules:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(sys.modules["kernels.routing"]._route_kernel, InterpretedFunction):
            for name in (
                "kernels.jit_helpers",  # first: every kernel module below calls its helpers
                "kernels.routing",
                "kernels.mhc",
                "kernels.metadata",
                "kernels.indexer",
                "kernels.indexer_select",
                "kernels.indexer_fused",
                "kernels.sparse_attention",
                "kernels.sparse_attention_heads",  # after sparse_attention, whose helpers it takes
                "kernels.ring_offsets",  # before kernels.compressor, which calls its ring_row
                "kernels.compressor",
                "kernels.kv_store",
                "kernels.kv_workspace",  # after kv_store, whose encoder and decoder it calls
                "kernels.moe_align",  # before kernels.moe, which imports it
                "kernels.expert_slots",  # after moe_align, whose sort it calls
                "kernels.fp8_dequant",  # before kernels.moe and the fp8 linears, which import it
                "kernels.moe_gemv",  # before kernels.moe, which imports it
                "kernels.moe_gemm",  # before moe_dequant and moe, which launch its GEMMs
                "kernels.moe_dequant",  # before kernels.moe, which imports it
                "kernels.moe",
                "kernels.fp8_splitk",  # before the fp8 linears, which take its counters
                "kernels.fp8_gemv",
                "kernels.fp8_w8a8",  # after fp8_gemv, whose launch helpers it calls
                "kernels.fp8_linear_cublas",
                "kernels.fp8_linear",
                "kernels.gated_silu",
                "kernels.norm_rope",
                "kernels.sampling",
                "kernels.step_tables",
            ):
                if name in sys.modules:
                    importlib.reload(sys.modules[name])
            importlib.reload(sys.modules["kernels"])

    # every interpreted launch is recorded, to be compiled for sm_90 (test_sm90_compile.py)
    from tests.kernels.sm90_build import record_launches

    record_launches()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_collection_modifyitems(items) -> None:
    """The sm_90 compile check runs after every test that records launches."""
    last = [i for i in items if "test_recorded_launches_compile_for_sm90" in i.nodeid]
    items[:] = [i for i in items if i not in last] + last
