"""K=V rows in and out of the paged cache's KV slots, in the layout's entry format.

`store` writes fresh rows [n, D] at global KV slots (-1 = skip) or at the window ring slots a
`RingSlots` names; `gather` decodes the rows at slots into a bf16 (model dtype) workspace;
`round_trip` gives fresh rows as a later `gather` will (a prefill chunk attends to its own rows
through it: chunk-size invariance); `gather_into` fills given workspace rows with both, in one
launch. All go through the `kv_store` / `kv_gather` ops (`kernels.kv_store`, one launch each;
their torch references are the byte codecs of `dsv4.ops.kv_codec`).
"""

from __future__ import annotations

import torch

from dsv4.runner.paged.geometry import CacheGeometry
from kernels.backend import KernelBackendConfig, resolve
from kernels.kv_store import RingSlots


def store(geo: CacheGeometry, slots: torch.Tensor | RingSlots, rows: torch.Tensor,
          kernels: KernelBackendConfig) -> None:  # fmt: skip
    """rows [n, D] -> KV slots [n] (-1 = not stored), or those `slots: RingSlots` computes."""
    if rows.shape[0] == 0:
        return
    fn = resolve("kv_store", kernels, rows.device)
    fn(rows.contiguous(), geo.kv_bytes, slots, fmt=geo.kv_format,
       rope_dim=geo.layout.model.qk_rope_head_dim)  # fmt: skip


def gather(geo: CacheGeometry, slots: torch.Tensor, dtype: torch.dtype,
           kernels: KernelBackendConfig) -> torch.Tensor:  # fmt: skip
    """KV slots [n] (all valid) -> rows [n, D] in `dtype`."""
    model = geo.layout.model
    fn = resolve("kv_gather", kernels, slots.device)
    return fn(geo.kv_bytes, slots, fmt=geo.kv_format, dim=model.head_dim,
              rope_dim=model.qk_rope_head_dim, out_dtype=dtype)  # fmt: skip


def round_trip(geo: CacheGeometry, rows: torch.Tensor,
               kernels: KernelBackendConfig) -> torch.Tensor:  # fmt: skip
    """rows [n, D] -> what `gather` returns for them after `store` (rows' dtype), computed in
    registers (the cache untouched); records at least as precise as the rows skip it."""
    exact = geo.kv_format == "fp32" or (geo.kv_format == "bf16" and rows.dtype == torch.bfloat16)
    if exact or rows.shape[0] == 0:
        return rows
    no_slots = torch.empty(0, dtype=torch.int64, device=rows.device)
    fn = resolve("kv_gather", kernels, rows.device)
    return fn(geo.kv_bytes, no_slots, fmt=geo.kv_format, dim=rows.shape[1],
              rope_dim=geo.layout.model.qk_rope_head_dim, out_dtype=rows.dtype,
              fresh=rows.contiguous())  # fmt: skip


def gather_into(geo: CacheGeometry, out: torch.Tensor, slots: torch.Tensor,
                out_rows: torch.Tensor, kernels: KernelBackendConfig, *, slot_offset: int = 0,
                slot_base: tuple[torch.Tensor, torch.Tensor] | None = None,
                fresh: torch.Tensor | None = None,
                fresh_rows: torch.Tensor | None = None) -> None:  # fmt: skip
    """Workspace out [M, D] rows out_rows [n] <- the records at KV slots [n] + slot_offset
    (+ table[index] with slot_base = (table, index [n])), and rows fresh_rows [F] <- fresh rows
    [F, D] as `round_trip` gives them (what a later chunk gathers: chunk invariance). One
    launch; nothing when there is nothing to write."""
    if slots.shape[0] == 0 and (fresh is None or fresh.shape[0] == 0):
        return
    model = geo.layout.model
    fn = resolve("kv_gather", kernels, out.device)
    fn(geo.kv_bytes, slots, fmt=geo.kv_format, dim=model.head_dim,
       rope_dim=model.qk_rope_head_dim, out_dtype=out.dtype, slot_offset=slot_offset,
       slot_base=slot_base, out=out, out_rows=out_rows,
       fresh=None if fresh is None else fresh.contiguous(), fresh_rows=fresh_rows)  # fmt: skip
