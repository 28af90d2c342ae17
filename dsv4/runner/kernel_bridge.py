"""The model's hot ops on the Triton kernels, op by op, as the kernel config says.

The model calls its hot ops through a `HotOps` (dsv4/model/hot_ops.py) with the shapes of the
torch references in dsv4/ops; the kernels in kernels/ take the same mathematical arguments but
flat [T, ...] rows and return int32 expert ids. The adapters here do that reshaping only.
`hot_ops` resolves them once per model from the `KernelBackendConfig` (each op's backend by the
rule `kernels.backend.resolve` applies) and whoever builds the model hands the result over with
`DeepseekV4.use_hot_ops`. Ops without an adapter here stay on their references.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dsv4.model.hot_ops import HotOps
from kernels import mhc, routing
from kernels.backend import KernelBackendConfig
from kernels.fp8_linear import fp8_grouped_linear, fp8_linear


def _route(logits, bias, token_ids, tid2eid, top_k, routed_scaling_factor):
    flat = logits.reshape(-1, logits.shape[-1]).float()
    if tid2eid is not None:
        w, ids = routing.hash_route(flat, token_ids.reshape(-1), tid2eid, routed_scaling_factor)
    else:
        w, ids = routing.route(flat, bias.float(), top_k, routed_scaling_factor)
    lead = logits.shape[:-1]
    return w.view(*lead, -1), ids.long().view(*lead, -1)


def _hc_pre(x, fn, scale, base, iters, eps, norm_eps):
    lead, (m, d) = x.shape[:-2], x.shape[-2:]
    u, post, comb = mhc.hc_pre(
        x.reshape(-1, m, d).contiguous(), fn, scale, base, iters, eps, norm_eps
    )
    return u.view(*lead, d), post.view(*lead, m), comb.view(*lead, m, m)


def _hc_post(y, x, post, comb):
    lead, (m, d) = x.shape[:-2], x.shape[-2:]
    out = mhc.hc_post(
        y.reshape(-1, d).contiguous(),
        x.reshape(-1, m, d).contiguous(),
        post.reshape(-1, m).contiguous(),
        comb.reshape(-1, m, m).contiguous(),
    )
    return out.view(*lead, m, d)


def _fp8_linear(x, weight, scale, activations="bf16"):
    return fp8_linear(x, weight, scale, activations)  # takes [..., K] as the model passes it


def _fp8_grouped_linear(x, weight, scale, activations="bf16"):
    return fp8_grouped_linear(x, weight, scale, activations)


# model hot op -> (kernel op that decides its backend, adapter)
BRIDGES: dict[str, tuple[str, Callable[..., Any]]] = {
    "route": ("route", _route),
    "hc_pre": ("hc_pre", _hc_pre),
    "hc_post": ("hc_post", _hc_post),
    "fp8_linear": ("fp8_linear", _fp8_linear),
    "fp8_grouped_linear": ("fp8_grouped_linear", _fp8_grouped_linear),
}


def kernel_choices(config: KernelBackendConfig, device: torch.device | str) -> dict[str, str]:
    """{bridged hot op: "triton" | "ref"} on `device` (for the start-up log and tests)."""
    return {op: config.backend_for(kernel_op, device) for op, (kernel_op, _) in BRIDGES.items()}


def hot_ops(config: KernelBackendConfig, device: torch.device | str) -> HotOps:
    """The model's hot ops on `device`: the adapter of every bridged op whose kernel op the
    config puts on Triton, the torch reference for the rest."""
    chosen = kernel_choices(config, device)
    return HotOps(**{op: BRIDGES[op][1] for op, backend in chosen.items() if backend == "triton"})
