"""Per-step sizes stay out of every kernel's compile key (kernels/specialize.py).

A size argument left in the key compiled new variants inside a client's TTFT whenever a prompt
length flipped its "divisible by 16" class; a block-table stride passed as a constexpr compiled
one variant per distinct block count. This walks every Triton kernel of the package."""

from __future__ import annotations

import importlib
import pkgutil

import kernels

# argument names that carry a token / entry / pair / tile count or a per-step width
SIZE_NAMES = {"T", "N", "n", "B", "C", "num_pairs", "num_pid_m", "max_tiles", "total",
              "num_reqs", "split_len", "width", "comp_base", "STRIDE_BT", "stride_bt",
              "num_partials", "num_splits", "d_per_split"}  # fmt: skip
# sizes that are fixed by the model and the layout, not by the step
FIXED = {
    ("_hc_pre_kernel", "N"),
    ("_hc_finish_kernel", "N"),  # N = mix outputs, M(2 + M)
    ("_ring_offsets_kernel", "C"),  # C = ring rows per compressed entry
    ("_fp8_linear_kernel", "N"),  # N = a linear's output features
    ("_fp8_gemv_kernel", "N"),
    ("_fp8_dequant_kernel", "N"),  # N = a weight's rows
}


def _kernels():
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"kernels.{info.name}")
        for name, obj in vars(module).items():
            if name.endswith("_kernel") and hasattr(obj, "fn"):
                yield name, obj


def _unspecialised(kernel) -> set[str]:
    if hasattr(kernel, "params"):  # JITFunction (GPU)
        return {p.name for p in kernel.params if p.do_not_specialize}
    return set(kernel.kwargs.get("do_not_specialize") or ())  # InterpretedFunction (CPU)


def _constexprs(kernel) -> set[str]:
    import inspect

    return {n for n, p in inspect.signature(kernel.fn).parameters.items()
            if "constexpr" in str(p.annotation)}  # fmt: skip


def test_every_size_argument_is_left_out_of_the_compile_key() -> None:
    found = dict(_kernels())
    assert len(found) >= 20, sorted(found)  # the walk sees the package's kernels
    for name, kernel in found.items():
        import inspect

        params = set(inspect.signature(kernel.fn).parameters)
        sizes = {p for p in params & SIZE_NAMES if (name, p) not in FIXED}
        assert not sizes & _constexprs(kernel), (name, "a per-step size as a constexpr")
        missing = sizes - _unspecialised(kernel)
        assert not missing, f"{name}: {sorted(missing)} vary per step but are specialised"
