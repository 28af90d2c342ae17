"""tools/launch_count.py's counters: which calls launch, copy or sync, and where each counts.

Counted as on CUDA: aten ops on device tensors that launch (`Launches`; a same-dtype copy of
contiguous tensors is a memcpy, which the profiler's "launches" leave out), host syncs (scalar
reads, `.tolist()`/`.cpu()`, uploads without non_blocking, `SYNC_OPS`, bool-mask indexing,
repeat_interleave without output_size); Triton launches are recorded by launch_count.py's hooks
through `LaunchCounter.record`. On the device (`Residency`): tensors older than the step (weights,
cache, cached tables), factories given a `device=` other than "cpu", `.to(device)` uploads,
results of ops on device tensors; `is_cuda` is True for those, so wrappers take their CUDA
branches (`.device.type` stays "cpu": decode-sized configs read it). Components
(`LaunchCounter.where`): the innermost registered op (`OP_COMPONENTS`), else the innermost frame
with a rule (an nn.Module by name: `MODULE_RULES`; a dsv4/ function: `FUNCTION_RULES`); the layer
is the `block` of `PagedForward._block` on the stack, else "step" (metadata, embedding, head,
sampler).

Kept apart from launch_count.py, which patches the kernels, builds a worker and runs its step:
these modes alone count the launches of any host code (tests/engine/test_step_tables_host.py
counts the step tables' builders with them).
"""

from __future__ import annotations

import contextlib
import linecache
import os
import re
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

import dsv4.runner.paged.forward as paged_forward

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/launch_rules.py
from launch_rules import FACTORIES, FUNCTION_RULES, MODULE_RULES, NO_LAUNCH, OP_COMPONENTS, SYNC_OPS

ROOT = Path(__file__).resolve().parents[1]

_CALL_IMPL = torch.nn.Module._call_impl.__code__
_IS_CUDA = torch._C.TensorBase.__dict__["is_cuda"]  # Tensor.is_cuda's descriptor
_OURS = (str(ROOT / "dsv4") + os.sep, str(ROOT / "kernels") + os.sep)
_BLOCK = paged_forward.PagedForward._block.__code__


def _is_device_arg(device) -> bool:  # the forward passes its own torch.device
    return device is not None and not (isinstance(device, str) and device.startswith("cpu"))


class LaunchCounter:
    """Launches, memcpys and syncs of the step while `counting` (module doc)."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}  # id(module) -> qualified name
        self.layers: dict[int, str] = {}  # id(block) -> "0", "1", ...
        self.on_device = WeakIdKeyDictionary()  # tensor -> bool, for tensors made in steps
        self.events: list[tuple[str, ...]] = []  # (kind, op, region, component, site)
        self.syncs: list[tuple[str, ...]] = []  # (call, region, component, site)
        self.mismatches: Counter = Counter()  # ops whose reference values could not be copied
        self.counting = False
        self.silent = 0  # > 0: a reference computes values, nothing is counted
        self.dry = 0  # > 0: inside a registered op's Triton wrapper, launches skipped
        self.ops: list[str] = []  # registered ops running, innermost last
        self.factory: list[bool] = []  # device residency of the factory call running

    def device(self, t) -> bool:
        return self.on_device.get(t, True) if isinstance(t, torch.Tensor) else False

    def mark(self, out, on: bool):
        tree_map_only(torch.Tensor, lambda t: self.on_device.__setitem__(t, on), out)
        return out

    @property
    def active(self) -> bool:
        return self.counting and not self.silent

    @contextlib.contextmanager
    def quiet(self):
        self.silent += 1
        try:
            yield
        finally:
            self.silent -= 1

    def record(self, kind: str, op: str) -> None:
        self.events.append((kind, op, *self.where()))

    def sync(self, call: str) -> None:
        self.syncs.append((call, *self.where()))

    def where(self) -> tuple[str, str, str]:
        """(region, component, site: innermost file:line of dsv4/ or kernels/) of the caller."""
        region, component, site = "step", None, None
        if self.ops:
            component = OP_COMPONENTS.get(self.ops[-1], "other")
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            ours = code.co_filename.startswith(_OURS)
            if ours and site is None:
                site = f"{os.path.relpath(code.co_filename, ROOT)}:{frame.f_lineno}"
            if code is _CALL_IMPL and component is None:
                name = self.names.get(id(frame.f_locals.get("self")), "")
                component = next((c for p, c in MODULE_RULES if re.search(p, name)), None)
            elif code is _BLOCK:
                region = "layer" + self.layers.get(id(frame.f_locals.get("block")), "?")
                break
            elif component is None and ours:
                component = _function_rule(frame)
            frame = frame.f_back
        return region, component or "other", site or "?"


def _function_rule(frame) -> str | None:
    code = frame.f_code
    path = os.path.relpath(code.co_filename, ROOT).split(os.sep, 1)[-1]
    for rule in FUNCTION_RULES.get(path, "").split():
        place, component = rule.split("=")
        func, _, text = place.partition(":")
        if func in ("*", code.co_name) and text in linecache.getline(code.co_filename,
                                                                     frame.f_lineno):  # fmt: skip
            return component
    return None


class _Counting:
    def __init__(self, c: LaunchCounter) -> None:
        super().__init__()
        self.c = c


class Residency(_Counting, TorchFunctionMode):
    """Python-level calls that decide where a tensor lives and what a transfer costs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs, c, name = kwargs or {}, self.c, getattr(func, "__name__", "")
        if not c.active:
            return func(*args, **kwargs)
        if getattr(func, "__self__", None) is _IS_CUDA:
            return c.device(args[0])
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name == "pin_memory":  # a host buffer either way (and no CUDA to pin with here)
            return src
        if name in FACTORIES or name.endswith("_like") or name.startswith("new_"):
            on = _is_device_arg(kwargs.get("device")) or (
                src is not None and "device" not in kwargs and c.device(src))  # fmt: skip
            c.factory.append(on)
            try:  # (a pinned host buffer is a host buffer; no CUDA to pin with here)
                out = func(*args, **{k: v for k, v in kwargs.items() if k != "pin_memory"})
            finally:
                c.factory.pop()
            if on and name in ("tensor", "as_tensor", "new_tensor"):  # built on the host:
                c.record("memcpy", "memcpy HtoD")  # a blocking upload (memcpy_and_sync)
                c.sync(f"torch.{name}(device=)")
            return c.mark(out, on)
        if name == "mm" and kwargs.get("out_dtype") is not None:  # CUDA-only overload
            c.record("kernel", "aten::mm.dtype")
            with c.quiet():
                return c.mark(torch.mm(args[0].float(), args[1].float()), True)
        if src is not None and name in ("to", "cuda", "cpu", "tolist", "numpy"):
            return self._transfer(func, name, src, args, kwargs)
        return func(*args, **kwargs)

    def _transfer(self, func, name, src, args, kwargs):
        c, out = self.c, func(*args, **kwargs)
        dev = [("cuda" if c.device(a) else "cpu") if isinstance(a, torch.Tensor) else a
               for a in (*args[1:], kwargs.get("device"))
               if isinstance(a, (str, torch.device, torch.Tensor))]  # fmt: skip
        up = name == "cuda" or (name == "to" and bool(dev) and _is_device_arg(dev[0]))
        down = name in ("cpu", "tolist", "numpy") or (name == "to" and bool(dev) and not up)
        if (up and not c.device(src)) or (down and c.device(src)):
            if out is src:  # on the CPU `.to` returns its input: the copy is another tensor
                with c.quiet():
                    out = src.clone()
            c.record("memcpy", "memcpy HtoD" if up else "memcpy DtoH")
            if not kwargs.get("non_blocking"):  # CUDA: cudaMemcpyAsync + cudaStreamSynchronize
                c.sync(f"Tensor.{name}" + (" to the device without non_blocking" if up else ""))
            return c.mark(out, up) if isinstance(out, torch.Tensor) else out
        return out


class Launches(_Counting, TorchDispatchMode):
    """aten ops: which launch on the device, which are memcpys, which sync."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out, c = func(*args, **kwargs), self.c
        if not c.active:
            return out
        name = func.overloadpacket.__name__
        if c.dry and name in ("empty", "empty_strided", "empty_like", "new_empty"):
            out.zero_()  # a skipped launch writes nothing: zeros, not garbage, reach the host
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        on = any(c.device(t) for t in tensors) if tensors else bool(c.factory and c.factory[-1])
        if name == "copy_" and c.device(args[0]) != c.device(args[1]):
            on = c.device(args[0])
            c.record("memcpy", "memcpy HtoD" if on else "memcpy DtoH")
            if not (kwargs.get("non_blocking") or (len(args) > 2 and args[2])):
                c.sync("copy_ to the device" if on else "copy_ to the host")
            return c.mark(out, on)
        c.mark(out, on)
        if not on:
            return out
        if name in SYNC_OPS or _syncs(name, args, kwargs):
            c.sync(f"aten::{name}")
            c.record("memcpy", "memcpy DtoH")  # the value, or the output's size, read back
        if name not in NO_LAUNCH and any(t.numel() for t in tree_flatten(out)[0] if
                                         isinstance(t, torch.Tensor)):  # fmt: skip
            memcpy = _is_memcpy(name, tensors, out)
            c.record(*(("memcpy", "memcpy DtoD") if memcpy else ("kernel", f"aten::{name}")))
        return out


def _syncs(name: str, args, kwargs) -> bool:  # the host reads the output's size back
    if name in ("index", "index_put", "index_put_"):
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ())
    tensor_repeats = len(args) < 2 or isinstance(args[1], torch.Tensor)
    return name == "repeat_interleave" and tensor_repeats and kwargs.get("output_size") is None


def _is_memcpy(name: str, inputs, out) -> bool:
    """A same-dtype copy between contiguous tensors: cudaMemcpyAsync, no kernel."""
    if name not in ("copy_", "clone", "_to_copy") or not inputs:
        return False
    src = inputs[1 if name == "copy_" else 0]  # out: the copy, a tensor
    return src.dtype == out.dtype and src.is_contiguous() and out.is_contiguous()
