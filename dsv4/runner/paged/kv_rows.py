"""K=V rows in and out of the paged cache's KV slots, in the layout's entry format.

`store` writes fresh rows [n, D] at global KV slots (-1 = skip); `gather` decodes the rows at
slots into a bf16 (model dtype) workspace; `round_trip` gives fresh rows as a later `gather`
will (a prefill chunk attends to its own rows through it: chunk-size invariance). All go
through `kernels.kv_store` when that op is registered and selected (one launch each), else
through the byte codecs of `dsv4.ops.kv_codec` (the reference).

`kernels.kv_workspace` does a prefill chunk's whole workspace (and the window ring store) in
one launch; `workspace_op` is None when it is not registered, and the paged attention then
builds workspaces with the three above (the reference path, bit for bit the same rows).
`store_window` stores through it (a store alone) when registered, else through `store`.
"""

from __future__ import annotations

import torch

from dsv4.ops.kv_codec import decode_rows, encode_rows
from dsv4.runner.paged.geometry import CacheGeometry
from kernels.backend import KernelBackendConfig, resolve
from kernels.registry import op_names


def _kernel(name: str, kernels: KernelBackendConfig, device: torch.device):
    if name not in op_names():
        return None
    return resolve(name, kernels, device)


def workspace_op(kernels: KernelBackendConfig, device: torch.device):
    """`kernels.kv_workspace` (or its torch reference, as selected); None: not registered."""
    return _kernel("kv_workspace", kernels, device)


def store_window(geo: CacheGeometry, rel: torch.Tensor, base: torch.Tensor, rows: torch.Tensor,
                 kernels: KernelBackendConfig) -> None:  # fmt: skip
    """rows [T, D] -> the window ring's KV slots base + rel (rel [T] int32 ring-relative, -1 =
    not stored; base [T] int32 each token's ring page)."""
    if rows.shape[0] == 0:
        return
    fn = workspace_op(kernels, rows.device)
    if fn is None:
        store(geo, torch.where(rel >= 0, base.long() + rel, -1), rows, kernels)
        return
    no_rows = torch.empty(2, 0, dtype=torch.int32, device=rows.device)  # a store alone
    fn(rows, geo.kv_bytes, no_rows, base, rel, fmt=geo.kv_format,
       rope_dim=geo.layout.model.qk_rope_head_dim)  # fmt: skip


def store(geo: CacheGeometry, slots: torch.Tensor, rows: torch.Tensor,
          kernels: KernelBackendConfig) -> None:  # fmt: skip
    """rows [n, D] -> KV slots [n] (-1 = not stored)."""
    _store(geo.kv_bytes, geo.kv_format, geo.layout.model.qk_rope_head_dim, slots, rows, kernels)


def gather(geo: CacheGeometry, slots: torch.Tensor, dtype: torch.dtype,
           kernels: KernelBackendConfig) -> torch.Tensor:  # fmt: skip
    """KV slots [n] (all valid) -> rows [n, D] in `dtype`."""
    model = geo.layout.model
    return _gather(geo.kv_bytes, geo.kv_format, model.head_dim, model.qk_rope_head_dim, slots,
                   dtype, kernels)  # fmt: skip


def round_trip(geo: CacheGeometry, rows: torch.Tensor,
               kernels: KernelBackendConfig) -> torch.Tensor:  # fmt: skip
    """rows [n, D] -> what `gather` returns for them after `store` (rows' dtype), through an
    [n, entry_bytes] scratch; records at least as precise as the rows skip it."""
    exact = geo.kv_format == "fp32" or (geo.kv_format == "bf16" and rows.dtype == torch.bfloat16)
    if exact or rows.shape[0] == 0:
        return rows
    rope = geo.layout.model.qk_rope_head_dim
    scratch = torch.zeros(rows.shape[0], geo.kve, dtype=torch.uint8, device=rows.device)
    slots = torch.arange(rows.shape[0], device=rows.device)
    _store(scratch, geo.kv_format, rope, slots, rows, kernels)
    return _gather(scratch, geo.kv_format, rows.shape[1], rope, slots, rows.dtype, kernels)


def _store(kv_bytes: torch.Tensor, fmt: str, rope: int, slots: torch.Tensor, rows: torch.Tensor,
           kernels: KernelBackendConfig) -> None:  # fmt: skip
    if rows.shape[0] == 0:
        return
    fn = _kernel("kv_store", kernels, rows.device)
    if fn is not None:
        fn(rows.contiguous(), kv_bytes, slots, fmt=fmt, rope_dim=rope)
        return
    keep = slots >= 0
    kv_bytes[slots[keep].long()] = encode_rows(rows[keep], fmt, kv_bytes.shape[1], rope)


def _gather(kv_bytes: torch.Tensor, fmt: str, dim: int, rope: int, slots: torch.Tensor,
            dtype: torch.dtype, kernels: KernelBackendConfig) -> torch.Tensor:  # fmt: skip
    fn = _kernel("kv_gather", kernels, slots.device)
    if fn is not None:
        return fn(kv_bytes, slots, fmt=fmt, dim=dim, rope_dim=rope, out_dtype=dtype)
    return decode_rows(kv_bytes[slots.long()], fmt, dim, rope).to(dtype)
