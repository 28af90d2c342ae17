"""Compile the kernels the interpreter ran for Hopper (sm_90), on the CPU, with no GPU.

The CPU interpreter executes a kernel's Python, so it accepts code that Triton's compiler
rejects: one H200 call was lost to `_block_scale` returning a uint8 load in one constexpr branch
and an fp32 in the other ("Inconsistent return types"), which the interpreter never checks.
Triton's wheel carries the whole CUDA pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with its
own ptxas), so the same launches can be compiled for `GPUTarget("cuda", 90, 32)` here.

`record_launches()` wraps the interpreter's launch and keeps, per kernel, the first launch of
each distinct constexpr set (the compile key that matters here): argument types from the
tensors and scalars passed, constexpr values, num_warps / num_stages. `compile_recorded()`
compiles them in a child process without TRITON_INTERPRET (there `@triton.jit` builds real
JITFunctions, which the compiler needs for the kernels' callees). It compiles with this
machine's Triton, which may be newer than a GPU host's: a check of the code, not of that host.
"""

from __future__ import annotations

import inspect
import os
import pickle
import subprocess
import sys
import time
from dataclasses import astuple, dataclass
from pathlib import Path

import torch

_TORCH_TO_TRITON = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
    torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32",
    torch.int64: "i64", torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
}  # fmt: skip
_LAUNCH_OPTIONS = ("num_warps", "num_stages")
MAX_VARIANTS = 8  # constexpr sets kept per kernel and value of its FMT / HALVES constexprs
MAX_KERNEL_VARIANTS = 32  # and per kernel: kernels.moe_gemm's GEMMs take five FMT values
MAX_COMPILE_WORKERS = 4


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the compiler needs it (picklable: no tensors)."""

    module: str
    name: str
    signature: tuple[tuple[str, str], ...]  # (parameter, triton type or "constexpr")
    constexprs: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, int], ...]


class _Untyped(Exception):
    """An argument this module cannot name a Triton type for: the launch is not recorded."""


def _arg_type(value) -> str | None:
    if isinstance(value, torch.Tensor):
        if value.dtype not in _TORCH_TO_TRITON:
            raise _Untyped(value.dtype)
        return "*" + _TORCH_TO_TRITON[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None  # None and other values compile as constexprs


def launch_of(kernel, args: tuple, kwargs: dict) -> Launch | None:
    """The Launch of `kernel(*args, **kwargs)`; None when an argument cannot be typed."""
    params = inspect.signature(kernel.fn).parameters
    bound = dict(zip(kernel.arg_names, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k in params})
    signature, constexprs = [], []
    for name, param in params.items():
        if name not in bound:
            if param.default is inspect.Parameter.empty:
                return None
            bound[name] = param.default
        value = bound[name]
        kind = None if "constexpr" in str(param.annotation) else _arg_type(value)
        if kind is None:
            constexprs.append((name, getattr(value, "value", value)))
        signature.append((name, kind or "constexpr"))
    options = tuple((k, int(kwargs[k])) for k in _LAUNCH_OPTIONS if k in kwargs)
    module = kernel.fn.__module__
    return Launch(module, kernel.fn.__name__, tuple(signature), tuple(constexprs), options)


# (module, kernel) -> its recorded launches; filled once `record_launches()` ran. Import this
# module only as `tests.kernels.sm90_build`, so there is one such dict.
RECORDED: dict[tuple[str, str], list[Launch]] = {}


def _fmt(launch: Launch):
    """A launch's weight-format constexprs, FMT (kernels.moe_gemm) and HALVES (kernels.moe_gemv)
    (None without them): each format or layout compiles its own code, so one format's tests do
    not use up the variants another's would record."""
    consts = dict(launch.constexprs)
    return consts.get("FMT"), consts.get("HALVES")


def record_launches() -> None:
    """Wrap the interpreter's launch so that every kernel launch fills RECORDED."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    if getattr(run, "records", False):
        return

    def recording_run(self, *args, grid, warmup, **kwargs):
        key = (self.fn.__module__, self.fn.__name__)
        # a kernel whose variants are all kept costs its launches nothing more
        if key[0].startswith("kernels.") and len(RECORDED.get(key, ())) < MAX_KERNEL_VARIANTS:
            try:
                launch = launch_of(self, args, kwargs)
            except _Untyped:
                launch = None
            kept = RECORDED.get(key, [])
            fmt = None if launch is None else _fmt(launch)
            if (launch is not None and all(k.constexprs != launch.constexprs for k in kept)
                    and sum(_fmt(k) == fmt for k in kept) < MAX_VARIANTS):  # fmt: skip
                RECORDED.setdefault(key, []).append(launch)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    recording_run.records = True
    InterpretedFunction.run = recording_run


def _compiler_env() -> tuple[dict[str, str], Path]:
    """A child's environment without TRITON_INTERPRET, the repository first on its path."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns on every compile otherwise
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    return env, root


def sass_lines(only: str, timeout_s: float = 600.0) -> list[str]:
    """`tools/attn_sass.py --only ONLY` (sm_90 compile: registers, stack, shared memory)."""
    env, root = _compiler_env()
    child = subprocess.run([sys.executable, "tools/attn_sass.py", "--only", only],
                           capture_output=True, text=True, env=env, cwd=root, timeout=timeout_s,
                           check=True)  # fmt: skip
    return [line for line in child.stdout.splitlines() if line.startswith(only)]


def compile_recorded(launches: list[Launch], timeout_s: float = 900.0,
                     workers: int = 0) -> list[str]:  # fmt: skip
    """Compile every launch for sm_90 in child processes, `workers` of them side by side (0:
    one a core, at most `MAX_COMPILE_WORKERS`: each compile is one core's work, and the suite
    runs this test alone on the machine); returns one line per failure."""
    env, root = _compiler_env()
    workers = max(1, min(workers or os.cpu_count() or 1, MAX_COMPILE_WORKERS, len(launches)))
    children = []
    for i in range(workers):  # every child gets its share before any is waited for
        child = subprocess.Popen([sys.executable, str(Path(__file__).resolve())],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env=env, cwd=root)  # fmt: skip
        children.append(child)
        assert child.stdin is not None  # a child reads its whole input before compiling
        child.stdin.write(pickle.dumps([astuple(launch) for launch in launches[i::workers]]))
        child.stdin.close()
        child.stdin = None  # closed: communicate() only reads
    deadline, failures = time.monotonic() + timeout_s, []
    try:
        for child in children:
            out, err = child.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            if child.returncode != 0:
                failures.append(f"the compile process failed ({child.returncode}): {err[-3000:]!r}")
            else:
                failures += pickle.loads(out)
    finally:
        for child in children:  # a timeout or error: none outlives the check
            if child.poll() is None:
                child.kill()
                child.wait()
    return failures


# constexprs that only the interpreter sets (`not x.is_cuda` at every launch): fp32 operands
# for its MMA, rounding its casts cannot do. A card compiles them off, so the check does too
# (compiled as recorded, the e4m3 MMA of kernels/fp8_w8a8.py and moe_w4a8.py went unchecked).
INTERPRETER_ONLY = ("UPCAST", "ROUND")


def _as_on_gpu(constexprs: tuple) -> dict:
    return {k: (False if k in INTERPRETER_ONLY else v) for k, v in constexprs}


def _compile_all(launches: list[tuple]) -> list[str]:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target, failures = GPUTarget("cuda", 90, 32), []
    for launch in (Launch(*fields) for fields in launches):
        kernel = getattr(importlib.import_module(launch.module), launch.name)
        src = ASTSource(kernel, dict(launch.signature), _as_on_gpu(launch.constexprs))
        try:
            triton.compile(src, target=target, options=dict(launch.options))
        except Exception as exc:  # reported per kernel, with its message
            consts = {k: v for k, v in _as_on_gpu(launch.constexprs).items() if k.isupper()}
            cause = f" <- {exc.__cause__!r}" if exc.__cause__ is not None else ""
            failures.append(f"{launch.module}.{launch.name} {consts}: "
                            f"{type(exc).__name__}: {str(exc)[-1500:]}{cause[:1500]}")  # fmt: skip
    return failures


if __name__ == "__main__":
    sys.stdout.buffer.write(pickle.dumps(_compile_all(pickle.loads(sys.stdin.buffer.read()))))
