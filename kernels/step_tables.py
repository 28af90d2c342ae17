"""A captured decode step's per-token tables in two launches: the compressor tables of a ratio
(`compressor_tables`) and the window's (`window_tables`).

A graph-captured step has its positions on the device only (a replay brings new ones), so the
tables every compressor of one ratio reads are built there each step: per token t at position p
of request r (every token gets a compress program; the kernel idles the non-boundary ones),

    reqs[t]        = r
    num_in_step[t] = p - starts[r] + 1
    cand_slots[t]  = (p - C + 1 + j) mod S for j < C, -1 where that position is < 0
                     (C = overlap · ratio candidate positions, S = C + draft slots ring rows)
    entry          = max((p + 1) // ratio - 1, 0)                 the entry p would close
    entry_col[t]   = min(entry // epb, max_col), entry_row[t] = entry mod epb
    angles[t]      = float32(entry · ratio) · freq                [rope / 2] (rope of the entry)
    save_slots[t]  = p mod S if p >= ends[r] - S else -1          (no later token reuses it)
    phase[t]       = p mod ratio                                  (its ape row)

As torch ops these were ~33 launches per ratio and step, the largest group of a 4-layer decode
step's 259 (two ratios: 85 compressor launches). Integer math and one fp32 product per angle:
kernel and reference agree exactly; the caller takes cos and sin of the angles in torch (the
same two kernels, hence the same bits, as the host-built tables of an eager step).

The window tables: per layer l and token t of request r at position p, with R the window ring's
slots, SPB the KV slots of a ring block and (rbi[l], base[l]) layer l's window page,

    win_base[l, t] = ring_ids[r, rbi[l]] · SPB + base[l]          (int32, the page's first slot)
    c4_lens[t]     = (p + 1) // 4                                  (visible ratio-4 entries)
    win_rel[t]     = p mod R if p >= ends[r] - R else -1           (the window store's slot)

(16 torch launches a step: a gather, a transpose, casts, the mask). Positions are >= 0 (padding
rows of a graph sit at position 0), token_to_req in [0, B).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.registry import register_op
from kernels.specialize import sizes_vary

BLOCK_T_TOKENS = 32  # tokens a program of either kernel


class CompressorTableTensors(NamedTuple):
    tokens: torch.Tensor  # [T] int32: 0..T-1 (every token a program)
    reqs: torch.Tensor  # [T] int64
    num_in_step: torch.Tensor  # [T] int32
    cand_slots: torch.Tensor  # [T, C] int64
    entry_col: torch.Tensor  # [T] int64
    entry_row: torch.Tensor  # [T] int64
    angles: torch.Tensor  # [T, rope/2] fp32
    save_slots: torch.Tensor  # [T] int64
    phase: torch.Tensor  # [T] int64


@triton.jit
def _token_block(pos_ptr, t2r_ptr, T, BLOCK_T: tl.constexpr):
    """The program's BLOCK_T tokens: (flat index int32, in range, position, request) [BLOCK_T]
    (positions and requests as int64)."""
    i = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = i < T
    p = tl.load(pos_ptr + i, mask=ok, other=0).to(tl.int64)
    req = tl.load(t2r_ptr + i, mask=ok, other=0).to(tl.int64)
    return i, ok, p, req


@triton.jit(**sizes_vary("T", "max_col"))
def _compressor_tables_kernel(
    pos_ptr, t2r_ptr, starts_ptr, ends_ptr, freq_ptr,  # [T] int, [T] int, [B], [B], [HALF] fp32
    tok_ptr, req_ptr, nis_ptr, cand_ptr, col_ptr, row_ptr, ang_ptr, save_ptr, phase_ptr,
    T, max_col,
    RATIO: tl.constexpr, NUM_CAND: tl.constexpr, SLOTS: tl.constexpr, EPB: tl.constexpr,
    HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    i, ok, p, req = _token_block(pos_ptr, t2r_ptr, T, BLOCK_T)
    start = tl.load(starts_ptr + req, mask=ok, other=0).to(tl.int64)
    end = tl.load(ends_ptr + req, mask=ok, other=0).to(tl.int64)
    entry = tl.maximum((p + 1) // RATIO - 1, 0)
    tl.store(tok_ptr + i, i, mask=ok)
    tl.store(req_ptr + i, req, mask=ok)
    tl.store(nis_ptr + i, (p - start + 1).to(tl.int32), mask=ok)
    tl.store(col_ptr + i, tl.minimum(entry // EPB, max_col), mask=ok)
    tl.store(row_ptr + i, entry % EPB, mask=ok)
    tl.store(save_ptr + i, tl.where(p >= end - SLOTS, p % SLOTS, -1), mask=ok)
    tl.store(phase_ptr + i, p % RATIO, mask=ok)
    c = tl.arange(0, BLOCK_C)
    cand = p[:, None] - NUM_CAND + 1 + c[None, :]  # [BLOCK_T, BLOCK_C]
    slot = tl.where(cand >= 0, cand % SLOTS, -1)  # cand % SLOTS only where cand >= 0
    tl.store(cand_ptr + i[:, None] * NUM_CAND + c[None, :], slot,
             mask=ok[:, None] & (c[None, :] < NUM_CAND))  # fmt: skip
    h = tl.arange(0, BLOCK_H)
    freq = tl.load(freq_ptr + h, mask=h < HALF, other=0.0)
    angles = (entry * RATIO).to(tl.float32)[:, None] * freq[None, :]  # [BLOCK_T, BLOCK_H]
    tl.store(ang_ptr + i[:, None] * HALF + h[None, :], angles,
             mask=ok[:, None] & (h[None, :] < HALF))  # fmt: skip


def _empty_tables(t: int, num_cand: int, half: int, device: torch.device) -> CompressorTableTensors:
    i32, i64 = torch.int32, torch.int64
    return CompressorTableTensors(
        torch.empty(t, dtype=i32, device=device), torch.empty(t, dtype=i64, device=device),
        torch.empty(t, dtype=i32, device=device), torch.empty(t, num_cand, dtype=i64, device=device),
        torch.empty(t, dtype=i64, device=device), torch.empty(t, dtype=i64, device=device),
        torch.empty(t, half, dtype=torch.float32, device=device),
        torch.empty(t, dtype=i64, device=device), torch.empty(t, dtype=i64, device=device),
    )  # fmt: skip


def compressor_tables(
    positions: torch.Tensor, token_to_req: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
    freq: torch.Tensor, *, ratio: int, num_cand: int, slots: int, entries_per_block: int,
    max_col: int,
) -> CompressorTableTensors:  # fmt: skip
    """positions [T] int >= 0, token_to_req [T] int, starts/ends [B] int (the step's), freq
    [rope/2] fp32 (the ratio's) -> the tables above, one launch."""
    assert positions.is_contiguous() and token_to_req.is_contiguous() and freq.is_contiguous()
    assert starts.stride(0) == 1 and ends.stride(0) == 1
    t, half = positions.shape[0], freq.shape[0]
    out = _empty_tables(t, num_cand, half, positions.device)
    if t:
        _compressor_tables_kernel[(triton.cdiv(t, BLOCK_T_TOKENS),)](
            positions, token_to_req, starts, ends, freq, *out, t, max_col,
            RATIO=ratio, NUM_CAND=num_cand, SLOTS=slots, EPB=entries_per_block, HALF=half,
            BLOCK_T=BLOCK_T_TOKENS, BLOCK_C=triton.next_power_of_2(num_cand),
            BLOCK_H=triton.next_power_of_2(half), num_warps=4,
        )  # fmt: skip
    return out


def compressor_tables_ref(
    positions: torch.Tensor, token_to_req: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
    freq: torch.Tensor, *, ratio: int, num_cand: int, slots: int, entries_per_block: int,
    max_col: int,
) -> CompressorTableTensors:  # fmt: skip
    """The formulas above as torch ops (the captured step's tables before this kernel)."""
    dev = positions.device
    p, req = positions.long(), token_to_req.long()  # [T]
    cand = p[:, None] - num_cand + 1 + torch.arange(num_cand, device=dev)  # [T, C]
    entry = ((p + 1) // ratio - 1).clamp(min=0)
    keep = p >= ends[req].long() - slots
    return CompressorTableTensors(
        torch.arange(p.shape[0], dtype=torch.int32, device=dev), req,
        (p - starts[req].long() + 1).int(), torch.where(cand >= 0, cand % slots, -1),
        (entry // entries_per_block).clamp(max=max_col), entry % entries_per_block,
        (entry * ratio).to(torch.float32)[:, None] * freq,
        torch.where(keep, p % slots, -1), p % ratio,
    )  # fmt: skip


class WindowTableTensors(NamedTuple):
    win_base: torch.Tensor  # [L, T] int32
    c4_lens: torch.Tensor  # [T] int32
    win_rel: torch.Tensor  # [T] int32


@triton.jit(**sizes_vary("T", "L"))
def _window_tables_kernel(
    pos_ptr, t2r_ptr, ends_ptr, ring_ptr, rbi_ptr, base_ptr,  # [T], [T], [B], [B, NR], [L], [L]
    win_ptr, lens_ptr, rel_ptr,  # [L, T], [T], [T] int32
    T, L, stride_ring, spb,
    RING: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    i, ok, p, req = _token_block(pos_ptr, t2r_ptr, T, BLOCK_T)
    end = tl.load(ends_ptr + req, mask=ok, other=0).to(tl.int64)
    tl.store(lens_ptr + i, ((p + 1) // 4).to(tl.int32), mask=ok)
    tl.store(rel_ptr + i, tl.where(p >= end - RING, p % RING, -1).to(tl.int32), mask=ok)
    for l0 in range(0, L, BLOCK_L):
        layer = l0 + tl.arange(0, BLOCK_L)  # [BLOCK_L]
        lok = layer < L
        rbi = tl.load(rbi_ptr + layer, mask=lok, other=0)
        base = tl.load(base_ptr + layer, mask=lok, other=0)
        both = lok[:, None] & ok[None, :]  # [BLOCK_L, BLOCK_T]
        block = tl.load(ring_ptr + req[None, :] * stride_ring + rbi[:, None], mask=both, other=0)
        tl.store(win_ptr + layer[:, None].to(tl.int64) * T + i[None, :],
                 (block * spb + base[:, None]).to(tl.int32), mask=both)  # fmt: skip


def window_tables(
    positions: torch.Tensor, token_to_req: torch.Tensor, ends: torch.Tensor,
    ring_ids: torch.Tensor, rbi: torch.Tensor, base: torch.Tensor, *, slots_per_block: int,
    ring: int,
) -> WindowTableTensors:  # fmt: skip
    """positions [T] int >= 0, token_to_req [T] int, ends [B] int, ring_ids [B, NR] int64, rbi
    and base [L] int64 (every layer's window page) -> the window tables above, one launch."""
    assert positions.is_contiguous() and token_to_req.is_contiguous()
    assert ends.stride(0) == 1 and ring_ids.stride(1) == 1 and ring_ids.dtype == torch.int64
    assert rbi.is_contiguous() and base.is_contiguous() and rbi.shape == base.shape
    t, num_l, dev = positions.shape[0], rbi.shape[0], positions.device
    out = WindowTableTensors(torch.empty(num_l, t, dtype=torch.int32, device=dev),
                             torch.empty(t, dtype=torch.int32, device=dev),
                             torch.empty(t, dtype=torch.int32, device=dev))  # fmt: skip
    if t:
        _window_tables_kernel[(triton.cdiv(t, BLOCK_T_TOKENS),)](
            positions, token_to_req, ends, ring_ids, rbi, base, *out, t, num_l,
            ring_ids.stride(0), slots_per_block, RING=ring, BLOCK_T=BLOCK_T_TOKENS,
            BLOCK_L=min(triton.next_power_of_2(max(num_l, 1)), 16), num_warps=4,
        )  # fmt: skip
    return out


def window_tables_ref(
    positions: torch.Tensor, token_to_req: torch.Tensor, ends: torch.Tensor,
    ring_ids: torch.Tensor, rbi: torch.Tensor, base: torch.Tensor, *, slots_per_block: int,
    ring: int,
) -> WindowTableTensors:  # fmt: skip
    """The formulas above as torch ops (the captured step's tables before this kernel)."""
    req = token_to_req.long()
    blocks = ring_ids[req][:, rbi]  # [T, L]
    keep = positions >= ends[req] - ring
    return WindowTableTensors(
        (blocks * slots_per_block + base).T.int().contiguous(), ((positions + 1) // 4).int(),
        torch.where(keep, positions % ring, -1).int(),
    )  # fmt: skip


register_op("compressor_tables", compressor_tables, compressor_tables_ref, family="step_tables")
register_op("window_tables", window_tables, window_tables_ref, family="step_tables")
