"""A prefill chunk's attention workspace in one launch, and the step's window ring store with it.

`kv_workspace` writes the workspace [M, D] (the fresh rows' dtype) a chunk's sparse prefill
attention reads (docs/model.md#prefill-workspaces). Workspace row r has a source (slot, tok) =
`src[:, r]` (int32, built on the host with the chunk's tables):
- slot >= 0: the cache record at global KV slot `slot + base`, decoded as `kv_gather` does;
  base = `win_base[tok]` (a window-prefix row: tok is a token of its request, whose ring page
  starts there) when tok >= 0, else `comp_base` (a compressed entry of the layer's page);
- slot < 0, tok >= 0: fresh row `rows[tok]` through the entry format in registers, quantised
  and dequantised exactly as `kv_store` then `kv_gather` would (what later chunks and decode
  steps read back: chunk-size invariance);
- both < 0: zeros (padding rows no candidate names).
It replaces the gathers, the scratch round trip and the index_puts of the chunk's rows (5-8
launches a chunk and layer; `kv_rows` keeps them as the fallback).

With `store` ([T] int32, -1 = not stored) the same launch also writes token t's record at
global slot `win_base[t] + store[t]` (the window ring, `kv_store`'s bytes), in programs past
the workspace's. Those programs run beside the workspace's, so no workspace row may read a
slot the call stores (the caller checks that on the host: `ForwardState.claim_window_store`);
the reference reads first, then stores. M = 0 is a store alone.

Kernel: one program per BLOCK_N workspace rows (or BLOCK_T stored tokens), the whole row in
registers; each row takes the cache path and the fresh path under masks, and `tl.where` picks
(kv_store's own encoder and decoder: `kv_fp8_encode` / `kv_fp8_decode`, `store_records`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops.kv_codec import decode_rows, round_trip
from kernels.jit_helpers import bf16_rne, kv_fp8_decode, kv_fp8_encode
from kernels.kv_store import (
    FORMATS,
    _check,
    block_rows,
    kv_store_ref,
    load_bits,
    load_f32,
    load_fp8_records,
    record_tiles,
    store_out,
    store_records,
)
from kernels.registry import register_op
from kernels.specialize import sizes_vary


@triton.jit
def _workspace_rows(
    rows_ptr, cache_ptr, src_ptr, base_ptr, out_ptr, n,  # n [BLOCK_N] workspace rows
    M, comp_base, stride_row, stride_cache, stride_src, stride_base, stride_out,
    D: tl.constexpr, ROPE: tl.constexpr, FMT: tl.constexpr, IN_BF16: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    in_n = n < M
    slot = tl.load(src_ptr + n, mask=in_n, other=-1)  # [BLOCK_N]
    tok = tl.load(src_ptr + stride_src + n, mask=in_n, other=-1)  # [BLOCK_N]
    cached = slot >= 0
    fresh = (slot < 0) & (tok >= 0)
    ring = tl.load(base_ptr + tl.maximum(tok, 0).to(tl.int64) * stride_base,
                   mask=cached & (tok >= 0), other=0)  # fmt: skip
    slot = slot + tl.where(tok >= 0, ring, comp_base)  # global KV slot of cached rows
    rec = cache_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_cache  # [BLOCK_N]
    row = rows_ptr + tl.maximum(tok, 0).to(tl.int64) * stride_row  # [BLOCK_N]
    dst = out_ptr + n.to(tl.int64) * stride_out  # [BLOCK_N]
    j = tl.arange(0, BLOCK_E)
    if FMT == 0:
        NOPE: tl.constexpr = D - ROPE
        col = tl.arange(0, BLOCK_C)[:, None] * 64 + tl.arange(0, 64)[None, :]  # [BLOCK_C, 64]
        in_nope = (col < NOPE)[None, :, :]
        # [BLOCK_N, BLOCK_C, 64] uint8, [BLOCK_N, BLOCK_C] int32, [BLOCK_N, BLOCK_E] fp32
        codes, e, rope = load_fp8_records(rec, cached, NOPE, ROPE, BLOCK_C, BLOCK_E)
        x = load_f32(row[:, None, None] + col[None, :, :], fresh[:, None, None] & in_nope, IN_BF16)
        own_codes, own_e = kv_fp8_encode(x)  # what kv_store writes for the fresh rows
        codes = tl.where(cached[:, None, None], codes, own_codes.to(tl.uint8))
        e = tl.where(cached[:, None], e, own_e + 127)
        store_out(dst[:, None, None] + col[None, :, :], kv_fp8_decode(codes, e),
                  in_n[:, None, None] & in_nope, IN_BF16)  # fmt: skip
        in_rope = (j < ROPE)[None, :]
        own = bf16_rne(load_f32(row[:, None] + NOPE + j[None, :], fresh[:, None] & in_rope,
                                IN_BF16))  # fmt: skip
        store_out(dst[:, None] + NOPE + j[None, :], tl.where(cached[:, None], rope, own),
                  in_n[:, None] & in_rope, IN_BF16)  # fmt: skip
    else:
        W: tl.constexpr = 2 if FMT == 1 else 4
        in_d = (j < D)[None, :]
        bits = load_bits(rec[:, None] + W * j[None, :], cached[:, None] & in_d, W)
        if FMT == 1:
            bits = bits << 16
        own = load_f32(row[:, None] + j[None, :], fresh[:, None] & in_d, IN_BF16)
        if FMT == 1:
            own = bf16_rne(own)
        store_out(dst[:, None] + j[None, :],
                  tl.where(cached[:, None], bits.to(tl.float32, bitcast=True), own),
                  in_n[:, None] & in_d, IN_BF16)  # fmt: skip


# src's row stride is its width M, a size: out of the compile key with the others
@triton.jit(**sizes_vary("M", "T", "num_ws", "comp_base", "stride_src"))
def _workspace_kernel(
    # Pointers: rows [T, D] (fp32, or bf16 as int16); cache [S, ENTRY] u8; src [2, M] i32;
    # win_base [T] i32 (stride_base, may be 0); store [T] i32 (-1 = skip); out [M, D] as rows
    rows_ptr, cache_ptr, src_ptr, base_ptr, store_ptr, out_ptr,
    # Sizes (programs [0, num_ws) build the workspace, the rest store) and strides
    M, T, num_ws, comp_base, stride_row, stride_cache, stride_src, stride_base, stride_out,
    # Meta-parameters (kernels.kv_store's)
    D: tl.constexpr, ROPE: tl.constexpr, ENTRY: tl.constexpr, USED: tl.constexpr,
    FMT: tl.constexpr,  # 0 fp8_ue8m0, 1 bf16, 2 fp32
    IN_BF16: tl.constexpr,  # rows and workspace bf16 (else fp32)
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,  # workspace rows / stored tokens a program
    BLOCK_C: tl.constexpr,  # fp8: nope blocks of 64
    BLOCK_E: tl.constexpr,  # fp8: rope elements; bf16/fp32: row elements
    BLOCK_B: tl.constexpr, BLOCK_Z: tl.constexpr,  # the store's record bytes, zero tail
):  # fmt: skip
    pid = tl.program_id(0)
    if pid < num_ws:
        _workspace_rows(rows_ptr, cache_ptr, src_ptr, base_ptr, out_ptr,
                        pid * BLOCK_N + tl.arange(0, BLOCK_N), M, comp_base, stride_row,
                        stride_cache, stride_src, stride_base, stride_out, D, ROPE, FMT, IN_BF16,
                        BLOCK_C, BLOCK_E)  # fmt: skip
    else:
        t = (pid - num_ws) * BLOCK_T + tl.arange(0, BLOCK_T)
        rel = tl.load(store_ptr + t, mask=t < T, other=-1)  # [BLOCK_T] ring-relative slots
        ok = rel >= 0
        slot = tl.load(base_ptr + t.to(tl.int64) * stride_base, mask=ok, other=0) + rel
        store_records(rows_ptr + t.to(tl.int64) * stride_row,
                      cache_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_cache, ok, D, ROPE,
                      ENTRY, USED, FMT, IN_BF16, BLOCK_T, BLOCK_C, BLOCK_B, BLOCK_Z)  # fmt: skip


def kv_workspace(
    rows: torch.Tensor,
    cache: torch.Tensor,
    src: torch.Tensor,
    win_base: torch.Tensor,
    store: torch.Tensor | None = None,
    *,
    fmt: str,
    rope_dim: int = 64,
    comp_base: int = 0,
) -> torch.Tensor:
    """rows [T, D] bf16/fp32 (stride(1) == 1): the step's fresh K=V rows; cache [S, entry]
    uint8 records; src [2, M] int32 (contiguous rows) the workspace rows' sources (module doc);
    win_base [T] int32 (any stride) each token's window page base; store [T] int32 or None:
    ring-relative slots to store the rows at (-1 = not; none read by a workspace row)
    -> workspace [M, D] in rows' dtype."""
    num_t, dim = rows.shape
    _check(cache, src[0], fmt, dim, rope_dim)
    assert rows.dtype in (torch.bfloat16, torch.float32) and rows.stride(1) == 1, rows.dtype
    assert src.dtype == torch.int32 and src.shape[0] == 2 and src.stride(1) == 1, src.shape
    assert win_base.dtype == torch.int32 and win_base.shape == (num_t,), win_base.shape
    num_ws = src.shape[1]
    out = torch.empty(num_ws, dim, dtype=rows.dtype, device=rows.device)  # [M, D]
    if store is not None:
        assert store.dtype == torch.int32 and store.shape == (num_t,), store.shape
    num_st = 0 if store is None else num_t
    if num_ws + num_st == 0:
        return out
    tiles, on_gpu = record_tiles(fmt, dim, rope_dim), rows.is_cuda
    # each workspace row holds both paths' tiles: half kv_gather's rows a program
    block_n = block_rows(num_ws, 2 * tiles.gather_width, on_gpu)
    block_t = block_rows(num_st, tiles.store_width, on_gpu)
    grid_ws = triton.cdiv(num_ws, block_n)
    is_bf16 = rows.dtype == torch.bfloat16
    _workspace_kernel[(grid_ws + triton.cdiv(num_st, block_t),)](
        rows.view(torch.int16) if is_bf16 else rows, cache, src, win_base,
        src if store is None else store, out.view(torch.int16) if is_bf16 else out,
        num_ws, num_st, grid_ws, comp_base, rows.stride(0), cache.stride(0), src.stride(0),
        win_base.stride(0), out.stride(0),
        D=dim, ROPE=rope_dim, ENTRY=cache.shape[1], USED=tiles.used, FMT=FORMATS.index(fmt),
        IN_BF16=is_bf16, BLOCK_N=block_n, BLOCK_T=block_t, BLOCK_C=tiles.block_c,
        BLOCK_E=tiles.block_e, BLOCK_B=tiles.block_b,
        BLOCK_Z=triton.next_power_of_2(max(1, cache.shape[1] - tiles.used)),
        num_warps=4,
    )  # fmt: skip
    return out


def kv_workspace_ref(rows, cache, src, win_base, store=None, *, fmt, rope_dim=64, comp_base=0):
    """The rows' sources decoded (`decode_rows`), round-tripped (`kv_codec.round_trip`) or
    zeros; then the store (`kv_store_ref`)."""
    num_ws, dim = src.shape[1], rows.shape[1]
    slot, tok = src.long()  # [M] each
    base = torch.where(tok >= 0, win_base.long()[tok.clamp(min=0)], comp_base)
    out = torch.zeros(num_ws, dim, dtype=rows.dtype, device=rows.device)
    cached, fresh = slot >= 0, (slot < 0) & (tok >= 0)
    if cached.any():
        records = cache[(slot + base)[cached]]
        out[cached] = decode_rows(records, fmt, dim, rope_dim).to(rows.dtype)
    if fresh.any():
        out[fresh] = round_trip(rows[tok[fresh]], fmt, cache.shape[1], rope_dim)
    if store is not None:
        slots = torch.where(store >= 0, win_base.long() + store, -1)
        kv_store_ref(rows, cache, slots, fmt=fmt, rope_dim=rope_dim)
    return out


register_op("kv_workspace", kv_workspace, kv_workspace_ref, family="kv_workspace")
