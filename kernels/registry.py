"""Registry of kernel ops: name -> (triton fn, ref fn, optional slow-path baseline).

Every op is registered by the module that defines it (`kernels/<family>.py`), at import time of
the `kernels` package. The meta-test (`tests/kernels/test_registry.py`) fails when a registered
op lacks a reference or its family lacks `tests/kernels/test_<family>.py` naming the op.
`baseline_fn` is the earlier/unfused approach the benchmark measures the op against; when it is
None, the reference is the baseline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class OpSpec:
    name: str
    triton_fn: Callable
    ref_fn: Callable
    family: str  # kernels/<family>.py and tests/kernels/test_<family>.py
    baseline_fn: Callable | None = None

    @property
    def baseline(self) -> Callable:
        return self.baseline_fn or self.ref_fn


_OPS: dict[str, OpSpec] = {}


def register_op(
    name: str,
    triton_fn: Callable,
    ref_fn: Callable,
    *,
    family: str,
    baseline_fn: Callable | None = None,
) -> None:
    old = _OPS.get(name)
    if old is not None and old.triton_fn.__module__ != triton_fn.__module__:  # reload is fine
        raise ValueError(f"kernel op {name!r} registered by {old.triton_fn.__module__} already")
    _OPS[name] = OpSpec(name, triton_fn, ref_fn, family, baseline_fn)


def _ensure_loaded() -> None:
    import kernels  # noqa: F401  (registers every op)


def get_op(name: str) -> OpSpec:
    _ensure_loaded()
    try:
        return _OPS[name]
    except KeyError:
        raise KeyError(f"no kernel op {name!r}; known: {sorted(_OPS)}") from None


def op_names() -> list[str]:
    _ensure_loaded()
    return sorted(_OPS)


def all_ops() -> list[OpSpec]:
    _ensure_loaded()
    return [_OPS[n] for n in sorted(_OPS)]
