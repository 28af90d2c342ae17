"""Route the model's hot ops to the Triton kernels, op by op, as the kernel config says.

The model's reference ops (`@hot_op` in dsv4/model) and the kernels in kernels/ take the same
mathematical arguments but different shapes: the model passes [B, S, ...] batches and int64
expert ids, the kernels take flat [T, ...] rows and return int32 ids. The adapters here do that
reshaping only. Called once per process by whoever builds the model from the serve config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dsv4.model.layers import set_kernel_backend, set_kernels


def _route(logits, bias, token_ids, tid2eid, top_k, routed_scaling_factor):
    from kernels import routing

    flat = logits.reshape(-1, logits.shape[-1]).float()
    if tid2eid is not None:
        w, ids = routing.hash_route(flat, token_ids.reshape(-1), tid2eid, routed_scaling_factor)
    else:
        w, ids = routing.route(flat, bias.float(), top_k, routed_scaling_factor)
    lead = logits.shape[:-1]
    return w.view(*lead, -1), ids.long().view(*lead, -1)


def _hc_pre(x, fn, scale, base, iters, eps, norm_eps):
    from kernels import mhc

    lead, (m, d) = x.shape[:-2], x.shape[-2:]
    u, post, comb = mhc.hc_pre(
        x.reshape(-1, m, d).contiguous(), fn, scale, base, iters, eps, norm_eps
    )
    return u.view(*lead, d), post.view(*lead, m), comb.view(*lead, m, m)


def _hc_post(y, x, post, comb):
    from kernels import mhc

    lead, (m, d) = x.shape[:-2], x.shape[-2:]
    out = mhc.hc_post(
        y.reshape(-1, d).contiguous(),
        x.reshape(-1, m, d).contiguous(),
        post.reshape(-1, m).contiguous(),
        comb.reshape(-1, m, m).contiguous(),
    )
    return out.view(*lead, m, d)


def _fp8_linear(x, weight, scale, activations="bf16"):
    from kernels.fp8_linear import fp8_linear

    return fp8_linear(x, weight, scale, activations)  # takes [..., K] as the model passes it


def _fp8_grouped_linear(x, weight, scale, activations="bf16"):
    from kernels.fp8_linear import fp8_grouped_linear

    return fp8_grouped_linear(x, weight, scale, activations)


# model hot op -> (kernel op that decides its backend, adapter)
BRIDGES: dict[str, tuple[str, Callable[..., Any]]] = {
    "route": ("route", _route),
    "hc_pre": ("hc_pre", _hc_pre),
    "hc_post": ("hc_post", _hc_post),
    "fp8_linear": ("fp8_linear", _fp8_linear),
    "fp8_grouped_linear": ("fp8_grouped_linear", _fp8_grouped_linear),
}


def install_kernels(config: Any, device: torch.device | str) -> dict[str, str]:
    """Select each bridged op's backend from a `kernels.backend.KernelBackendConfig`.

    Returns {model op: "triton" | "ref"} for the start-up log."""
    chosen = {op: config.backend_for(kernel_op, device) for op, (kernel_op, _) in BRIDGES.items()}
    set_kernels("triton", {op: BRIDGES[op][1] for op, b in chosen.items() if b == "triton"})
    set_kernel_backend("triton" if "triton" in chosen.values() else "torch")
    return chosen
