"""K=V rows in and out of the paged cache's KV slots, in the layout's entry format.

`store` writes fresh rows [n, D] at global KV slots (-1 = skip); `gather` decodes the rows at
slots into a bf16 (model dtype) workspace. Both go through `kernels.kv_store` when that op is
registered and selected (one launch each), else through the byte codecs of
`dsv4.runner.kv_codec` (the reference).
"""

from __future__ import annotations

import torch

from dsv4.runner.kv_codec import decode_rows, encode_rows
from dsv4.runner.paged.geometry import CacheGeometry
from kernels.backend import KernelBackendConfig, resolve
from kernels.registry import op_names


def _kernel(name: str, kernels: KernelBackendConfig, device: torch.device):
    if name not in op_names():
        return None
    return resolve(name, kernels, device)


def store(geo: CacheGeometry, slots: torch.Tensor, rows: torch.Tensor,
          kernels: KernelBackendConfig) -> None:  # fmt: skip
    """rows [n, D] -> KV slots [n] (-1 = not stored)."""
    if rows.shape[0] == 0:
        return
    rope = geo.layout.model.qk_rope_head_dim
    fn = _kernel("kv_store", kernels, rows.device)
    if fn is not None:
        fn(rows.contiguous(), geo.kv_bytes, slots, fmt=geo.kv_format, rope_dim=rope)
        return
    keep = slots >= 0
    records = encode_rows(rows[keep], geo.kv_format, geo.kve, rope)
    geo.kv_bytes[slots[keep].long()] = records


def gather(geo: CacheGeometry, slots: torch.Tensor, dtype: torch.dtype,
           kernels: KernelBackendConfig) -> torch.Tensor:  # fmt: skip
    """KV slots [n] (all valid) -> rows [n, D] in `dtype`."""
    model = geo.layout.model
    fn = _kernel("kv_gather", kernels, slots.device)
    if fn is not None:
        return fn(geo.kv_bytes, slots, fmt=geo.kv_format, dim=model.head_dim,
                  rope_dim=model.qk_rope_head_dim, out_dtype=dtype)  # fmt: skip
    records = geo.kv_bytes[slots.long()]
    return decode_rows(records, geo.kv_format, model.head_dim, model.qk_rope_head_dim).to(dtype)
