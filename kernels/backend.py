"""The kernel backend switch: which implementation of an op runs, "ref" (torch) or "triton".

The choice comes from a frozen `KernelBackendConfig` that the serving config owns; this module
never reads environment variables. The lead's config loader is the one documented place that
parses the `DSV4_KERNELS` variable, with `KernelBackendConfig.parse`:

    DSV4_KERNELS="auto"                          every op: triton on CUDA, ref on CPU
    DSV4_KERNELS="triton,route=ref"              triton everywhere except the router
    DSV4_KERNELS="ref,hc_pre=triton,hc_post=auto"

"auto" resolves per call site from the device of the op's tensors: CUDA -> "triton", anything
else -> "ref". An explicit "triton" on CPU only works under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from dsv4.errors import ConfigError

BACKENDS = ("ref", "triton", "auto")


def _resolve_auto(device: torch.device | str | None) -> str:
    if device is None:
        return "triton" if torch.cuda.is_available() else "ref"
    return "triton" if torch.device(device).type == "cuda" else "ref"


def select_backend(
    op_name: str,
    default: str,
    overrides: Mapping[str, str],
    *,
    device: torch.device | str | None = None,
) -> str:
    """Returns "ref" or "triton" for `op_name`: its override if any, else `default`.

    "auto" resolves from `device` (CUDA -> "triton", else "ref"); with no device it asks
    whether CUDA is available at all.
    """
    choice = overrides.get(op_name, default)
    if choice not in BACKENDS:
        raise ConfigError(f"kernels.{op_name}", choice, f"use one of {', '.join(BACKENDS)}")
    return _resolve_auto(device) if choice == "auto" else choice


@dataclass(frozen=True)
class KernelBackendConfig:
    """Which backend each op uses. `overrides` maps an op name (see `registry.op_names()`)."""

    default: str = "auto"
    overrides: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.default not in BACKENDS:
            raise ConfigError("kernels.default", self.default, f"use one of {BACKENDS}")
        from kernels.registry import op_names

        known = set(op_names())
        for name, choice in self.overrides.items():
            if name not in known:
                raise ConfigError(f"kernels.{name}", choice, f"no such op; known: {sorted(known)}")
            if choice not in BACKENDS:
                raise ConfigError(f"kernels.{name}", choice, f"use one of {BACKENDS}")
        object.__setattr__(self, "overrides", MappingProxyType(dict(self.overrides)))

    def __reduce__(self):
        # pickled to a worker's follower ranks (in its engine options); a mappingproxy is not
        return (type(self), (self.default, dict(self.overrides)))

    @classmethod
    def parse(cls, spec: str) -> KernelBackendConfig:
        """Parses "default[,op=backend...]" (the DSV4_KERNELS format); "" means "auto"."""
        parts = [p.strip() for p in spec.split(",") if p.strip()]
        default = "auto"
        overrides: dict[str, str] = {}
        for part in parts:
            if "=" in part:
                name, _, choice = part.partition("=")
                overrides[name.strip()] = choice.strip()
            else:
                default = part
        return cls(default=default, overrides=overrides)

    def backend_for(self, op_name: str, device: torch.device | str | None = None) -> str:
        return select_backend(op_name, self.default, self.overrides, device=device)


def _first_device(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.device | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def resolve(op_name: str, config: KernelBackendConfig, device: torch.device | str) -> Callable:
    """The implementation of `op_name` for tensors on `device`; resolve once, call many times."""
    from kernels.registry import get_op

    spec = get_op(op_name)
    return spec.triton_fn if config.backend_for(op_name, device) == "triton" else spec.ref_fn


def dispatch(op_name: str, config: KernelBackendConfig, /, *args: Any, **kwargs: Any) -> Any:
    """Calls `op_name` through the switch; the device is that of the first tensor argument."""
    return resolve(op_name, config, _first_device(args, kwargs) or "cpu")(*args, **kwargs)
