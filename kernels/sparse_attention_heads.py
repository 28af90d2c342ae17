"""Sparse attention decode with every head of a token in one program (issue 25 item 3): the
`sparse_attention_decode` contract (kernels/sparse_attention.py), a different work split.

The default kernel's 64-head program spills on sm_90 (its [64 heads, 512] fp32 accumulator and
the hoisted q leave too few registers) and its 16-head fallback reads and dequantises each
candidate row four times (once per head block). Here one program owns all H heads of a token
(and one split of its candidate list), so each row is gathered and dequantised once, and the
two GEMMs are written transposed ("swap AB"):

    s^T [BLOCK_N, H]  = kv [BLOCK_N, D] @ q^T [D, H]          (q^T: the B operand, in smem)
    o^T [D, H]       += kv^T [D, BLOCK_N] @ p^T [BLOCK_N, H]   (kv^T: the same smem tile)

so the dequantised tile is written to shared memory once and feeds both wgmma as an smem
operand, q never sits in registers, and the output accumulator's M side is the 512-wide head
dim: with 8 warps each warpgroup owns 256 of the 512 output columns (128 fp32 registers a
thread), FlashMLA's split of the PV work. The softmax state (max, sum) is per head = per
column of s^T. Split-K and the sink are as in the default kernel (its `_combine_kernel`).

Selected by the paged forward's `attention_all_heads` switch (off until timed on the card);
the sm_90 compile evidence is in docs/BENCHMARKS.md and `tools/attn_sass.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.jit_helpers import candidate_slots, split_window
from kernels.registry import register_op
from kernels.sparse_attention import (
    LOG2E,
    checked_output,
    combine_splits,
    sparse_attention_decode_ref,
    split_plan,
)
from kernels.specialize import sizes_vary

_CPU_BLOCK_N = 16


@triton.jit
def _rows_t(kv_ptr, kv16_ptr, slot, ok, D: tl.constexpr, ROPE: tl.constexpr,
            ENTRY: tl.constexpr, DOT_BF16: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """[BLOCK_N, D] dequantised fp8_ds_mla rows at `slot` (0 where not ok), in the dot dtype:
    [nope e4m3 | rope bf16 | one UE8M0 byte per 64 nope dims]; exact in bf16."""
    NOPE = D - ROPE
    row = tl.where(ok, slot, 0).to(tl.int64)
    base = kv_ptr + row * ENTRY
    c = tl.arange(0, D // 64)
    j = tl.arange(0, 64)
    dt = tl.bfloat16 if DOT_BF16 else tl.float32
    # codes of every 64-dim chunk (the rope chunk's bytes are read but replaced below)
    codes = tl.load(base[:, None, None] + (c[None, :, None] * 64 + j[None, None, :]),
                    mask=ok[:, None, None] & (c * 64 < NOPE)[None, :, None], other=0)  # fmt: skip
    e = tl.load(base[:, None] + (NOPE + 2 * ROPE) + c[None, :],
                mask=ok[:, None] & (c * 64 < NOPE)[None, :], other=0)  # fmt: skip
    scale = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True).to(dt)  # 2^(e-127)
    nope = codes.to(tl.float8e4nv, bitcast=True).to(dt) * scale[:, :, None]
    rope = tl.load(kv16_ptr + (row * (ENTRY // 2) + NOPE // 2)[:, None] + j[None, :],
                   mask=ok[:, None], other=0.0)  # fmt: skip
    rope = rope.to(dt)
    kv = tl.where((c * 64 >= NOPE)[None, :, None], rope[:, None, :], nope)
    return tl.reshape(kv, (BLOCK_N, D))


@triton.jit(**sizes_vary("C", "stride_st", "split_len", "comp_base"))
def _attn_heads_kernel(
    # Pointers as kernels.sparse_attention._attn_kernel (fp8_ds_mla rows only)
    q_ptr, kv_ptr, kv16_ptr, slot_ptr, wbase_ptr, sink_ptr, o_ptr, lse_ptr,
    C, stride_qt, stride_qh, stride_st, stride_ot, stride_oh, split_len, qk_scale_log2,
    comp_base,
    H: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr, ENTRY: tl.constexpr,
    SPLIT: tl.constexpr, NUM_WIN: tl.constexpr, DOT_BF16: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, QK_T: tl.constexpr,
    LAZY: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    h_ok = h < H
    dot_t = tl.bfloat16 if DOT_BF16 else tl.float32
    # q^T [D, BLOCK_H]: the B operand of s^T, loaded once (into shared memory on the GPU)
    q_t = tl.load(q_ptr + pid_t * stride_qt + h[None, :] * stride_qh + d[:, None],
                  mask=h_ok[None, :], other=0.0).to(dot_t)  # fmt: skip

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of base-2 logits
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([D, BLOCK_H], tl.float32)  # o^T
    start, end, win_base = split_window(pid_t, pid_s, split_len, C, wbase_ptr, comp_base, NUM_WIN)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        slot, ok = candidate_slots(slot_ptr + pid_t * stride_st, n, end, win_base, comp_base,
                                   NUM_WIN)  # fmt: skip
        kv = _rows_t(kv_ptr, kv16_ptr, slot, ok, D, ROPE, ENTRY, DOT_BF16, BLOCK_N)
        if QK_T:
            s = tl.dot(kv, q_t) * qk_scale_log2  # [BLOCK_N, BLOCK_H]
        else:  # s = q @ kv^T: M = the heads, wgmma for BLOCK_N < 64 too
            s = tl.trans(tl.dot(tl.trans(q_t), tl.trans(kv))) * qk_scale_log2
        s = tl.where(ok[:, None], s, float("-inf"))
        m_blk = tl.max(s, 0)
        if LAZY:
            # rescale only when some head's max grew by more than 2^8 (FlashAttention-4's
            # lazy rescaling): p <= 256 meanwhile, exact as long as m_i is used consistently.
            # Rows are masked for all heads at once: an all-masked block (m_blk = -inf)
            # changes nothing, the first unmasked one always rescales (from -1e30).
            if tl.max(m_blk - tl.maximum(m_i, -1e30), 0) > 8.0:
                m_new = tl.maximum(m_i, m_blk)
                alpha = tl.exp2(m_i - m_new)
                acc = acc * alpha[None, :]
                l_i = l_i * alpha
                m_i = m_new
        else:
            m_new = tl.maximum(m_i, m_blk)
            alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
            acc = acc * alpha[None, :]
            l_i = l_i * alpha
            m_i = m_new
        m_use = tl.where(m_i == float("-inf"), 0.0, m_i)  # all masked so far: no NaN
        p = tl.exp2(s - m_use[None, :])
        l_i += tl.sum(p, 0)
        acc = tl.dot(tl.trans(kv), p.to(dot_t), acc)

    if SPLIT:
        row = (pid_t * tl.num_programs(1) + pid_s) * H + h  # [BLOCK_H] rows of [T, S, H]
        has = l_i > 0
        part = acc / tl.where(has, l_i, 1.0)[None, :]
        tl.store(o_ptr + row[None, :] * D + d[:, None], part.to(o_ptr.dtype.element_ty),
                 mask=h_ok[None, :])  # fmt: skip
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=h_ok)
    else:
        sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        w = tl.exp2(m_i - m_f)
        out = acc * (w / (l_i * w + tl.exp2(sink - m_f)))[None, :]
        o_off = pid_t * stride_ot + h[None, :] * stride_oh + d[:, None]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=h_ok[None, :])


# (BLOCK_N, num_warps, num_stages), all heads: checked by tools/attn_sass.py on sm_90a
GPU_CONFIG = (32, 8, 2)
LAZY_RESCALE = True  # skip the acc rescale unless a max grew by > 2^8
SWEEP = [
    (32, 8, 2, True, False),
    (32, 8, 2, True, True),
    (32, 8, 3, True, True),
    (32, 8, 2, False, True),
    (64, 8, 2, True, True),
]


def sparse_attention_decode_all_heads(q, kv_cache, slot_table, sink, scale, *, rope_dim=64,
                                      num_splits=None, win_base=None, num_win=0,
                                      comp_base=0, tune=None):  # fmt: skip
    """`kernels.sparse_attention.sparse_attention_decode` with one program per (token, split)
    for all heads; fp8_ds_mla rows only (uint8 `kv_cache`), H <= 64. `tune`: (BLOCK_N,
    num_warps, num_stages) for the sweeps."""
    assert kv_cache.dtype == torch.uint8 and q.shape[1] <= 64, "fp8 rows, at most 64 heads"
    out, done = checked_output(q, kv_cache, slot_table, sink, rope_dim, win_base, num_win)
    if done:
        return out
    num_tokens, num_heads, head_dim = q.shape
    num_cand = slot_table.shape[1]
    on_gpu = q.is_cuda
    block_n, warps, stages = tune or GPU_CONFIG
    if not on_gpu:
        block_n = _CPU_BLOCK_N
    num_splits, split_len, part, lse = split_plan(q, out, num_cand, num_splits, num_tokens, block_n)
    split = num_splits > 1
    wbase = win_base if num_win else slot_table  # unread when num_win == 0
    _attn_heads_kernel[(num_tokens, num_splits)](
        q, kv_cache, kv_cache.view(torch.bfloat16), slot_table, wbase, sink, part, lse,
        num_cand, q.stride(0), q.stride(1), slot_table.stride(0), out.stride(0), out.stride(1),
        split_len, scale * LOG2E, int(comp_base),
        H=num_heads, D=head_dim, ROPE=rope_dim, ENTRY=kv_cache.stride(0), SPLIT=split,
        NUM_WIN=num_win, DOT_BF16=on_gpu and q.dtype == torch.bfloat16,
        BLOCK_H=max(16, triton.next_power_of_2(num_heads)), BLOCK_N=block_n, QK_T=True, LAZY=LAZY_RESCALE,
        num_warps=warps if on_gpu else 4, num_stages=stages if on_gpu else 1,
    )  # fmt: skip
    if split:
        combine_splits(part, lse, sink, out)
    return out


def sparse_attention_decode_all_heads_ref(q, kv_cache, slot_table, sink, scale, *, rope_dim=64,
                                          num_splits=None, win_base=None, num_win=0,
                                          comp_base=0, tune=None):  # fmt: skip
    return sparse_attention_decode_ref(q, kv_cache, slot_table, sink, scale, rope_dim=rope_dim,
                                       win_base=win_base, num_win=num_win, comp_base=comp_base)  # fmt: skip


register_op("sparse_attention_decode_all_heads", sparse_attention_decode_all_heads,
            sparse_attention_decode_all_heads_ref, family="sparse_attention_heads",
            baseline_fn=None)  # fmt: skip
