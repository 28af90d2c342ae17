"""Small building blocks shared by the model files, and the kernel switch.

Norms follow docs/model.md#norms: statistics in fp32, the weight applied in fp32, one cast back.

Kernel switch: the hot ops (routing, hc_pre/hc_post, sparse attention with sink, compressor,
indexer scores/top-k) are plain-torch functions decorated with `@hot_op("name")`. A kernel
module registers a replacement with `register_kernel("name", fn)` (same signature), and
`set_kernel_backend("triton")` routes every decorated call to its registered replacement.
The default backend "torch" always runs the reference function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

F = TypeVar("F", bound=Callable[..., Any])

_KERNELS: dict[str, dict[str, Callable[..., Any]]] = {}
_BACKEND = "torch"


def set_kernel_backend(backend: str) -> None:
    """Select which implementation of the hot ops runs ("torch" = the reference)."""
    global _BACKEND
    _BACKEND = backend


def kernel_backend() -> str:
    return _BACKEND


def register_kernel(name: str, fn: Callable[..., Any], backend: str = "triton") -> None:
    """Register `fn` as the `backend` implementation of hot op `name` (same signature)."""
    _KERNELS.setdefault(backend, {})[name] = fn


def set_kernels(backend: str, impls: dict[str, Callable[..., Any]]) -> None:
    """Replace every `backend` implementation at once (start-up from the frozen config)."""
    _KERNELS[backend] = dict(impls)


def hot_op(name: str) -> Callable[[F], F]:
    """Mark a reference function as swappable by the kernel switch."""

    def wrap(ref: F) -> F:
        @functools.wraps(ref)
        def dispatch(*args: Any, **kwargs: Any) -> Any:
            if _BACKEND != "torch":
                impl = _KERNELS.get(_BACKEND, {}).get(name)
                if impl is not None:
                    return impl(*args, **kwargs)
            return ref(*args, **kwargs)

        dispatch.reference = ref  # type: ignore[attr-defined]
        return dispatch  # type: ignore[return-value]

    return wrap


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim; fp32 math, output in x.dtype."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype)


class RMSNorm(nn.Module):
    """Weighted RMSNorm; the parameter is `weight` so state_dict keys read `<name>.weight`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def linear(in_features: int, out_features: int) -> nn.Linear:
    """Bias-free linear (every DeepSeek-V4 projection is bias-free)."""
    return nn.Linear(in_features, out_features, bias=False)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T computed in fp32 (compressor and router math, docs/model.md#norms)."""
    return torch.nn.functional.linear(x.float(), weight.float())
