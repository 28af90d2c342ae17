"""Sparse attention with sink over the packed FP8 cache, decode and prefill
(docs/model.md#attention-with-sink).

Every query token t attends its own candidate list `slot_table[t]` (window slots, then the
indexer's top-k or all visible compressed slots; -1 = no entry) of rows in ONE flat cache view
`kv_cache [num_slots, entry_bytes]` (`dsv4.cache.layout`: every KV entry of every layer has a
global slot id). K = V = the 512-d row; the per-head sink logit enlarges the denominator only:

    o_h = sum_j e^{l_j} kv_j / (sum_j e^{l_j} + e^{sink_h}),   l_j = scale * q_h . kv_j

Kernel (`_attn_kernel`): one program per (token, block of BLOCK_H heads, split of the candidate
list). All heads of a token share its candidates, so the heads are the M dimension of both
GEMMs. Per BLOCK_N candidates it gathers the rows as [BLOCK_N, D/64, 64] chunks (e4m3 chunks x
their 2^(e-127) scale, the last chunk the bf16 rope: exact in bf16, so the GPU path never
leaves bf16), and runs QK^T and PV on tensor cores with a base-2 online softmax; -1 slots are
masked. Which head block size wins (64 heads on wgmma vs 16 on mma.sync) is left to the
autotuner: see `_GPU_CONFIGS` for what the sm_90a compile of each looks like.

Split-K (flash-decoding): a decode batch of 64 tokens x 1 head block is only 64 programs on 132
SMs, and each one is tensor-core bound (64 x 640 x 512 x 4 FLOP), so the candidate list is split
until ~one wave of programs is busy (2 splits at T = 64, none at T >= 128). Each split writes
its normalised partial output (bf16 on the GPU: half the traffic) and base-2 LSE;
`_combine_kernel` merges the splits and applies the sink. With one split the sink is applied in
the attention kernel itself.

Prefill (`sparse_attention_prefill`): the same kernel with per-row slot lists (the FlashMLA
sparse-prefill contract: rows of a chunk share most candidates, which then hit in L2) and never
split (a chunk has thousands of rows). `kv_cache` may also be a bf16 [num_slots, D] workspace,
e.g. compressed entries dequantised once per chunk, as vLLM does.

`sparse_attention_decode_ref` / `sparse_attention_prefill_ref`: gather, `kv_codec.decode_rows`,
softmax with the sink column: equal to `dsv4.model.attention.sparse_attention` on the gathered
candidates.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from dsv4.ops.kv_codec import decode_rows
from kernels.jit_helpers import candidate_slots, split_window
from kernels.registry import register_op
from kernels.specialize import sizes_vary

LOG2E = 1.4426950408889634
_SPLIT_ALIGN = 64  # GPU split boundaries are multiples of every BLOCK_N
_CPU_BLOCK_N = 32  # interpreter: candidate block (and split alignment)


@triton.jit
def _load_rows(kv_ptr, kv16_ptr, slot, ok, d,
               D: tl.constexpr, ROPE: tl.constexpr, ENTRY: tl.constexpr, KV_FP8: tl.constexpr,
               DOT_BF16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_D] rows at `slot` in the dot dtype, 0 where not ok or d >= D. Dequantised
    values (e4m3 x 2^k, bf16 rope) are exact in bf16, so the GPU path stays in bf16."""
    row = tl.where(ok, slot, 0).to(tl.int64)
    dt = tl.bfloat16 if DOT_BF16 else tl.float32
    if KV_FP8:  # [nope e4m3 | rope bf16 | one UE8M0 byte per 64 nope dims]
        # The row as [BLOCK_N, BLOCK_D / 64, 64]: chunks < NOPE/64 are e4m3 x their scale, the last
        # chunk(s) the bf16 rope. Only the row mask is per element (no [BLOCK_N, D] masks).
        NOPE = D - ROPE
        c = tl.arange(0, BLOCK_D // 64)
        j = tl.arange(0, 64)
        base = kv_ptr + row * ENTRY  # [BLOCK_N] row starts
        codes = tl.load(base[:, None, None] + (c[None, :, None] * 64 + j[None, None, :]),
                        mask=ok[:, None, None], other=0)  # fmt: skip
        e = tl.load(base[:, None] + (NOPE + 2 * ROPE) + c[None, :],
                    mask=ok[:, None] & (c * 64 < NOPE)[None, :], other=0)  # fmt: skip
        scale = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True).to(dt)  # 2^(e-127)
        nope = codes.to(tl.float8e4nv, bitcast=True).to(dt) * scale[:, :, None]
        rope = tl.load(kv16_ptr + (row * (ENTRY // 2) + NOPE // 2)[:, None] + j[None, :],
                       mask=ok[:, None] & (j < ROPE)[None, :], other=0.0)  # fmt: skip
        if not DOT_BF16:
            rope = rope.to(tl.float32)  # the interpreter keeps bf16 as raw uint16
        is_rope = (c * 64 >= NOPE)[None, :, None]
        kv = tl.where(is_rope, rope[:, None, :], nope)
        return tl.reshape(kv, (BLOCK_N, BLOCK_D))
    else:
        mask = ok[:, None] & (d < D)[None, :]
        return tl.load(kv_ptr + row[:, None] * ENTRY + d[None, :], mask=mask, other=0.0).to(dt)


@triton.jit(**sizes_vary("C", "stride_st", "split_len", "comp_base"))
def _attn_kernel(
    # Pointers: q [T, H, D]; kv rows [num_slots, ENTRY] (uint8 fp8 rows, or bf16/fp32 rows) and
    # the same storage viewed as bf16 (rope of fp8 rows); slots [T, C] int32, -1 = none;
    # sink [H] fp32; out [T, H, D] (SPLIT=False) or partial o [T, S, H, D] (SPLIT=True);
    # lse [T, S, H] fp32 base-2 (SPLIT=True only); win_base [T] int32 (NUM_WIN > 0 only)
    q_ptr, kv_ptr, kv16_ptr, slot_ptr, wbase_ptr, sink_ptr, o_ptr, lse_ptr,
    # Sizes, strides (elements), scalars
    C, stride_qt, stride_qh, stride_st, stride_ot, stride_oh, split_len, qk_scale_log2,
    comp_base,  # added to every valid slot past the first NUM_WIN (a layer's page offset)
    # Meta-parameters
    H: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr, ENTRY: tl.constexpr,
    KV_FP8: tl.constexpr,  # rows are fp8_ue8m0 bytes (else plain float rows)
    SPLIT: tl.constexpr,  # write partials for _combine_kernel (else finish with the sink here)
    NUM_WIN: tl.constexpr,  # the first NUM_WIN candidates are window slots + win_base[t]
    DOT_BF16: tl.constexpr,  # bf16 tensor-core dots (GPU); fp32 under the interpreter
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(2)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hd_ok = (h < H)[:, None] & (d < D)[None, :]
    # q goes to the dot straight from its load (GPU), so it can stay in shared memory.
    q = tl.load(q_ptr + pid_t * stride_qt + h[:, None] * stride_qh + d[None, :], mask=hd_ok,
                other=0.0)  # fmt: skip
    dot_t = tl.bfloat16 if DOT_BF16 else tl.float32
    if not DOT_BF16:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of base-2 logits
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    start, end, win_base = split_window(pid_t, pid_s, split_len, C, wbase_ptr, comp_base, NUM_WIN)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        slot, ok = candidate_slots(slot_ptr + pid_t * stride_st, n, end, win_base, comp_base,
                                   NUM_WIN)  # fmt: skip
        kv = _load_rows(kv_ptr, kv16_ptr, slot, ok, d, D, ROPE, ENTRY, KV_FP8, DOT_BF16, BLOCK_N,
                        BLOCK_D)  # fmt: skip
        s = tl.dot(q, tl.trans(kv)) * qk_scale_log2  # [BLOCK_H, BLOCK_N]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: no NaN
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_t), kv)
        m_i = m_new

    if SPLIT:
        num_splits = tl.num_programs(2)
        row = (pid_t * num_splits + pid_s) * H + h  # [BLOCK_H] rows of [T, S, H]
        has = l_i > 0
        part = acc / tl.where(has, l_i, 1.0)[:, None]
        tl.store(o_ptr + row[:, None] * D + d[None, :], part.to(o_ptr.dtype.element_ty),
                 mask=hd_ok)  # fmt: skip
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=h < H)
    else:
        sink = tl.load(sink_ptr + h, mask=h < H, other=0.0).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        w = tl.exp2(m_i - m_f)
        out = acc * (w / (l_i * w + tl.exp2(sink - m_f)))[:, None]
        o_off = pid_t * stride_ot + h[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=hd_ok)


@triton.jit
def _combine_kernel(
    # Pointers: partial o [T, S, H, D] (bf16 on GPU), lse [T, S, H] fp32 base 2, sink [H]; out
    po_ptr, lse_ptr, sink_ptr, o_ptr,
    stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < H
    hd_ok = h_ok[:, None] & (d < D)[None, :]
    m = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    sink = m
    for s in range(NUM_SPLITS):
        lse = tl.load(lse_ptr + (pid_t * NUM_SPLITS + s) * H + h, mask=h_ok, other=float("-inf"))
        m = tl.maximum(m, lse)
    denom = tl.exp2(sink - m)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(NUM_SPLITS):
        row = (pid_t * NUM_SPLITS + s) * H + h
        w = tl.exp2(tl.load(lse_ptr + row, mask=h_ok, other=float("-inf")) - m)
        part = tl.load(po_ptr + row[:, None] * D + d[None, :], mask=hd_ok, other=0.0)
        part = part.to(tl.float32)
        acc += w[:, None] * part
        denom += w
    out = acc / denom[:, None]
    o_off = pid_t * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=hd_ok)


# (BLOCK_H, BLOCK_N, num_warps, num_stages). Checked by AOT-compiling for sm_90a (ptxas usage):
# 64 heads = one wgmma M tile, but Triton gives chained dots all warps on M, so with 8 warps the
# QK^T is computed by both warpgroups and the [64, 512] fp32 acc (128 regs) leaves too few
# registers for the hoisted q descriptors (a few hundred bytes of spills); 16 heads on
# mma.sync (4 warps) compile without spills but read each candidate row once per head block
# (from L2) and dequantise it 4x. The tuner picks on the real card.
_GPU_CONFIGS = [
    (64, 32, 8, 2),
    (64, 64, 8, 2),
    (16, 32, 4, 2),
    (16, 64, 4, 2),
]


def _prune(configs, named_args, **kwargs):
    max_h = max(16, triton.next_power_of_2(named_args.get("H", kwargs.get("H", 64))))
    kept = [c for c in configs if c.kwargs["BLOCK_H"] <= max_h]
    return kept or configs[-1:]


@functools.cache
def _tuned_attn_kernel():
    configs = [
        triton.Config({"BLOCK_H": bh, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bh, bn, w, s in _GPU_CONFIGS
    ]
    return triton.autotune(configs, key=["H", "D", "ENTRY", "KV_FP8", "SPLIT"],
                           prune_configs_by={"early_config_prune": _prune})(_attn_kernel)  # fmt: skip


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check(q, kv_cache, slot_table, sink, rope_dim):
    num_tokens, num_heads, head_dim = q.shape
    assert slot_table.dim() == 2 and slot_table.shape[0] == num_tokens
    assert slot_table.dtype == torch.int32 and slot_table.stride(1) == 1
    assert q.stride(2) == 1 and sink.shape == (num_heads,)
    assert head_dim >= 64 and head_dim % 2 == 0
    if kv_cache.dtype == torch.uint8:  # the kernel reads a row as 64-dim chunks, rope last
        nope = head_dim - rope_dim
        assert head_dim & (head_dim - 1) == 0 and rope_dim == 64, "fp8 rows: 2^k dims, rope 64"
        assert kv_cache.stride(1) == 1 and kv_cache.stride(0) % 2 == 0
        assert kv_cache.shape[1] >= nope + 2 * rope_dim + math.ceil(nope / 64)
    else:
        assert kv_cache.shape[1] == head_dim and kv_cache.stride(1) == 1


def checked_output(q, kv_cache, slot_table, sink, rope_dim, win_base, num_win):
    """(o [T, H, D] to fill, whether it is already final: no tokens or no candidates)."""
    _check(q, kv_cache, slot_table, sink, rope_dim)
    if num_win:
        assert win_base is not None and win_base.shape == (q.shape[0],)
        assert win_base.dtype == torch.int32 and 0 < num_win <= slot_table.shape[1]
    out = torch.empty_like(q)
    if q.shape[0] == 0 or slot_table.shape[1] == 0:
        return out.zero_(), True
    return out, False


def _launch(q, kv_cache, slot_table, sink, scale, rope_dim, num_splits, win_base=None,
            num_win=0, comp_base=0):  # fmt: skip
    out, done = checked_output(q, kv_cache, slot_table, sink, rope_dim, win_base, num_win)
    if done:
        return out
    num_tokens, num_heads, head_dim = q.shape
    num_cand = slot_table.shape[1]
    kv_fp8 = kv_cache.dtype == torch.uint8
    kv16 = kv_cache.view(torch.bfloat16) if kv_fp8 else kv_cache
    on_gpu = q.is_cuda
    programs = num_tokens * triton.cdiv(num_heads, 64)
    align = _SPLIT_ALIGN if on_gpu else _CPU_BLOCK_N
    num_splits, split_len, part, lse = split_plan(q, out, num_cand, num_splits, programs, align)
    split = num_splits > 1
    block_d = triton.next_power_of_2(head_dim)
    wbase = win_base if num_win else slot_table  # unread when num_win == 0
    args = (q, kv_cache, kv16, slot_table, wbase, sink, part, lse,
            num_cand, q.stride(0), q.stride(1), slot_table.stride(0), out.stride(0),
            out.stride(1), split_len, scale * LOG2E, int(comp_base))  # fmt: skip
    meta = dict(H=num_heads, D=head_dim, ROPE=rope_dim, ENTRY=kv_cache.stride(0), KV_FP8=kv_fp8,
                SPLIT=split, NUM_WIN=num_win, DOT_BF16=on_gpu and q.dtype == torch.bfloat16, BLOCK_D=block_d)  # fmt: skip
    if on_gpu:
        grid = lambda m: (num_tokens, triton.cdiv(num_heads, m["BLOCK_H"]), num_splits)  # noqa: E731
        _tuned_attn_kernel()[grid](*args, **meta)
    else:  # interpreter: one head block, one candidate block per step
        block_h = max(16, triton.next_power_of_2(num_heads))
        _attn_kernel[(num_tokens, 1, num_splits)](
            *args, **meta, BLOCK_H=block_h, BLOCK_N=_CPU_BLOCK_N
        )
    if split:
        combine_splits(part, lse, sink, out)
    return out


def split_plan(q, out, num_cand, num_splits, programs, align):
    """(num_splits, split_len, partial o [T, S, H, D], lse [T, S, H]) of a decode launch of
    `programs` programs a split; `num_splits` None: about one wave of programs on the GPU, 1 on
    CPU. Splits are multiples of `align` candidates. One split: `out` and no lse."""
    num_tokens, num_heads, head_dim = q.shape
    on_gpu = q.is_cuda
    if num_splits is None:
        fill = round(_num_sms(q.device.index or 0) / programs) if on_gpu else 1
        num_splits = max(1, min(fill, triton.cdiv(num_cand, 128)))
    split_len = triton.cdiv(triton.cdiv(num_cand, num_splits), align) * align
    num_splits = triton.cdiv(num_cand, split_len)
    if num_splits == 1:
        return 1, split_len, out, out  # lse unused
    # bf16 partials on the GPU: half the split-K traffic, one extra bf16 rounding
    part = q.new_empty(num_tokens, num_splits, num_heads, head_dim,
                       dtype=q.dtype if on_gpu else torch.float32)  # fmt: skip
    lse = torch.empty(num_tokens, num_splits, num_heads, device=q.device)
    return num_splits, split_len, part, lse


def combine_splits(part, lse, sink, out):
    """out [T, H, D] <- the split partials part [T, S, H, D] and lse [T, S, H], and the sink."""
    num_tokens, num_splits, num_heads, head_dim = part.shape
    block_h = min(16, num_heads) if out.is_cuda else num_heads
    block_h = triton.next_power_of_2(block_h)
    _combine_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        part, lse, sink, out, out.stride(0), out.stride(1), NUM_SPLITS=num_splits,
        H=num_heads, D=head_dim, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )  # fmt: skip


def sparse_attention_decode(q, kv_cache, slot_table, sink, scale, *, rope_dim=64,
                            num_splits=None, win_base=None, num_win=0, comp_base=0):  # fmt: skip
    """q [T, H, D] bf16 (fp32 for tests), kv_cache [num_slots, entry_bytes] uint8 "fp8_ue8m0"
    rows (or [num_slots, D] bf16/fp32 rows), slot_table [T, C] int32 global slots (-1 = none),
    sink [H] fp32, scale (512^-0.5) -> o [T, H, D] in q's dtype.

    `num_splits` (split-K over the candidates): None picks about one wave of programs on the
    GPU; 1 on CPU. `num_win` > 0: the first `num_win` columns are ring-relative window slots
    and row t reads slot + win_base[t] ([T] int32); every other valid slot reads slot +
    `comp_base`. One window table and one compressed table then serve every layer of a kind
    (each layer passes its own ring page bases and compressed page offset)."""
    return _launch(q, kv_cache, slot_table, sink, scale, rope_dim, num_splits, win_base, num_win,
                   comp_base)  # fmt: skip


def sparse_attention_prefill(q, kv_cache, slot_table, sink, scale, *, rope_dim=64):
    """Prefill: per-row candidate lists (the chunk's causal/top-k rule is already in
    `slot_table`), same shapes and contract as `sparse_attention_decode`, never split."""
    return _launch(q, kv_cache, slot_table, sink, scale, rope_dim, 1)


# --------------------------------------------------------------------------- references


def sparse_attention_decode_ref(q, kv_cache, slot_table, sink, scale, *, rope_dim=64,
                                num_splits=None, win_base=None, num_win=0, comp_base=0):  # fmt: skip
    num_tokens, head_dim, num_cand = q.shape[0], q.shape[2], slot_table.shape[1]
    if num_win or comp_base:
        shift = torch.full_like(slot_table, int(comp_base))
        if num_win:
            shift[:, :num_win] = win_base[:, None]
        slot_table = torch.where(slot_table >= 0, slot_table + shift, slot_table)
    ok = slot_table >= 0  # [T, C]
    rows = kv_cache[slot_table.clamp(min=0).long().flatten()]  # [T*C, entry]
    if kv_cache.dtype == torch.uint8:
        kv = decode_rows(rows, "fp8_ue8m0", head_dim, rope_dim)
    else:
        kv = rows.float()
    # -1 slots read row 0 above: zero them, so a workspace's unwritten row never meets p = 0.
    kv = kv.view(num_tokens, num_cand, head_dim).masked_fill(~ok[..., None], 0.0)  # [T, C, D]
    logits = torch.einsum("thd,tcd->thc", q.float(), kv) * scale
    logits = logits.masked_fill(~ok[:, None, :], float("-inf"))
    sinks = sink.float().view(1, -1, 1).expand(num_tokens, -1, 1)
    probs = torch.cat((logits, sinks), dim=-1).softmax(dim=-1)[..., :-1]  # [T, H, C]
    return torch.einsum("thc,tcd->thd", probs, kv).to(q.dtype)


def sparse_attention_prefill_ref(q, kv_cache, slot_table, sink, scale, *, rope_dim=64):
    return sparse_attention_decode_ref(q, kv_cache, slot_table, sink, scale, rope_dim=rope_dim)


register_op("sparse_attention_decode", sparse_attention_decode, sparse_attention_decode_ref,
            family="sparse_attention")  # fmt: skip
register_op("sparse_attention_prefill", sparse_attention_prefill, sparse_attention_prefill_ref,
            family="sparse_attention")  # fmt: skip
