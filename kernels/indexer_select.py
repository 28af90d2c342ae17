"""Indexer top-k written straight as global cache slots, and the "select everything" path.

`indexer_topk(scores [T, N], lengths [T], k, token_to_req, block_table, entries_per_block)`:
per token the k highest of scores[t, :lengths[t]] (ties to the lower index, as
`dsv4.model.indexer.indexer_topk`; all of them when lengths[t] <= k), written as the global
slots of those compressed entries,

    slot = block_table[req][i // E] * SLOTS_PER_BLOCK + SLOT_BASE + i % E

(defaults SLOTS_PER_BLOCK = E, SLOT_BASE = 0: the vLLM token-block slot; the layout's flat KV
view uses block_stride / kv_entry_bytes and region offset / kv_entry_bytes), -1 padded to k
columns, plus the valid count per token (0 for padding tokens). E, k, the slot constants and
the strides are compile-time constants (#51967), so the local -> global translation costs
nothing extra. The slots come out in ascending entry order (consumers treat them as a set).

Kernel: one program per token holds its score row (<= 16K entries in registers; longer rows
are streamed in chunks). The k-th largest score is found by a bitwise binary search on the
order-preserving uint32 image of the floats (at most 32 count rounds, stopping as soon as
exactly k entries are >= the candidate), then one pass keeps the entries above the threshold
plus the first (k - #above) ties and compacts them with a prefix sum. No sort.

`indexer_select_all` (#49486): when no row has more candidates than k (the host knows
max_seq_len // 4 <= k), skip the q projection, logits and top-k and write rows 0..n-1 as
slots, -1 after: same output contract, no scores needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.jit_helpers import token_request
from kernels.registry import register_op
from kernels.specialize import sizes_vary

_MAX_ROW_IN_REGISTERS = 16384


@triton.jit
def _sort_keys(row_ptr, i, n):
    """Order-preserving uint32 image of scores[i] (0 where i >= n; -0.0 counts as +0.0)."""
    x = tl.load(row_ptr + i, mask=i < n, other=0.0)
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.uint32, bitcast=True)
    key = bits ^ tl.where((bits >> 31) == 1, 0xFFFFFFFF, 0x80000000)
    return tl.where(i < n, key, 0)


@triton.jit
def _global_slots(bt_row, i, ok, E: tl.constexpr, SLOTS_PER_BLOCK: tl.constexpr,
                  SLOT_BASE: tl.constexpr):  # fmt: skip
    blk = tl.load(bt_row + i // E, mask=ok, other=0)
    return tl.where(ok, blk * SLOTS_PER_BLOCK + SLOT_BASE + i % E, -1)


@triton.jit
def _radix_threshold(row_ptr, n, offs, K: tl.constexpr, BLOCK: tl.constexpr,
                     ONE_CHUNK: tl.constexpr):  # fmt: skip
    """(the K-th largest sort key of scores[:n] (n > K), how many keys equal to it are among
    the top K) by an 8-bit radix select from the top: 4 histogram rounds instead of up to 32
    count rounds. `prefix` holds the decided high bits, `need` how many keys >= the answer
    are still wanted among those matching the prefix."""
    prefix = tl.zeros([], tl.uint32)
    need = K
    b = tl.arange(0, 256)
    if ONE_CHUNK:
        row_keys = _sort_keys(row_ptr, offs, n)
    for r in tl.static_range(4):
        shift = 24 - 8 * r
        if ONE_CHUNK:
            hist = _digit_histogram(row_keys, offs < n, prefix, shift, r)
        else:
            hist = tl.zeros([256], tl.int32)
            for c0 in range(0, n, BLOCK):
                keys = _sort_keys(row_ptr, c0 + offs, n)
                hist += _digit_histogram(keys, c0 + offs < n, prefix, shift, r)
        at_least = tl.sum(hist) - tl.cumsum(hist, 0) + hist  # matching keys with digit >= b
        best = tl.max(tl.where(at_least >= need, b, -1))  # >= 0: at_least[0] >= need
        need -= tl.sum(tl.where(b > best, hist, 0))
        prefix |= best.to(tl.uint32) << shift
    return prefix, need


@triton.jit
def _digit_histogram(keys, valid, prefix, shift: tl.constexpr, r: tl.constexpr):
    """Histogram [256] of the keys' 8-bit digit at `shift` among those whose higher digits
    equal `prefix`'s (all of them in round r = 0)."""
    match = valid
    if r > 0:
        match &= (keys >> (shift + 8)) == (prefix >> (shift + 8))
    return tl.histogram(((keys >> shift) & 255).to(tl.int32), 256, mask=match)


@triton.jit(**sizes_vary("N", "STRIDE_BT"))
def _topk_kernel(
    # Pointers: scores [T, N] fp32, lengths [T], token_to_req [T], block_table [B, nb] int32;
    # outputs slots [T, K] int32, lens [T] int32
    score_ptr, len_ptr, t2r_ptr, bt_ptr, out_ptr, lens_ptr,
    N, stride_st,
    # Compile-time top-k width, slot geometry and strides
    K: tl.constexpr, E: tl.constexpr, SLOTS_PER_BLOCK: tl.constexpr, SLOT_BASE: tl.constexpr,
    STRIDE_BT, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
    ONE_CHUNK: tl.constexpr,  # the whole row fits in BLOCK: load it once
    RADIX: tl.constexpr = False,  # issue 25's variant: the threshold by `_radix_threshold`
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    bt_row, n = token_request(t2r_ptr, len_ptr, bt_ptr, t, N, STRIDE_BT)
    row_ptr = score_ptr + t * stride_st
    offs = tl.arange(0, BLOCK)

    # Threshold: the largest thr with #(key >= thr) >= K, i.e. the K-th largest key (or any
    # thr with exactly K keys >= thr). n <= K keeps thr = 0: every entry is selected.
    thr = tl.zeros([], tl.uint32)
    num_above = 0
    above_known = 0
    if RADIX:
        if n > K:  # the radix select also counts the keys above its answer
            thr, num_ties = _radix_threshold(row_ptr, n, offs, K, BLOCK, ONE_CHUNK)
            num_above = K - num_ties
            above_known = 1
    elif n > K:
        if ONE_CHUNK:
            row_keys = _sort_keys(row_ptr, offs, n)
        bit = 31
        found = 0
        while (bit >= 0) & (found == 0):
            cand = thr | (tl.full([], 1, tl.uint32) << bit)
            if ONE_CHUNK:
                cnt = tl.sum((row_keys >= cand).to(tl.int32))
            else:
                cnt = 0
                for c0 in range(0, n, BLOCK):
                    cnt += tl.sum((_sort_keys(row_ptr, c0 + offs, n) >= cand).to(tl.int32))
            if cnt >= K:
                thr = cand
            found = (cnt == K).to(tl.int32)
            bit -= 1

    # Keep key > thr, plus the first (K - #above) keys == thr; compact in index order.
    if above_known == 0:
        for c0 in range(0, n, BLOCK):
            num_above += tl.sum((_sort_keys(row_ptr, c0 + offs, n) > thr).to(tl.int32))
    num_ties = K - num_above
    num_out = 0
    ties_before = 0
    for c0 in range(0, n, BLOCK):
        i = c0 + offs
        key = _sort_keys(row_ptr, i, n)
        tie = (key == thr) & (i < n)
        if RADIX:  # one scan: #above in the low 16 bits, #ties in the high (BLOCK <= 16384)
            both = tl.cumsum((key > thr).to(tl.int32) + (tie.to(tl.int32) << 16), axis=0)
            tie_rank = (both >> 16) + ties_before  # inclusive
            keep = (key > thr) | (tie & (tie_rank <= num_ties))
            pos = num_out - tl.minimum(ties_before, num_ties) + (both & 0xFFFF)
            pos += tl.minimum(tie_rank, num_ties) - 1
        else:
            tie_rank = tl.cumsum(tie.to(tl.int32), axis=0) + ties_before  # inclusive
            keep = (key > thr) | (tie & (tie_rank <= num_ties))
            pos = num_out + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        slot = _global_slots(bt_row, i, keep, E, SLOTS_PER_BLOCK, SLOT_BASE)
        tl.store(out_ptr + t * K + pos, slot, mask=keep)
        num_out += tl.sum(keep.to(tl.int32))
        ties_before += tl.sum(tie.to(tl.int32))
    for j0 in range(0, K, BLOCK_K):
        j = j0 + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + t * K + j, tl.full([BLOCK_K], -1, tl.int32),
                 mask=(j < K) & (j >= num_out))  # fmt: skip
    tl.store(lens_ptr + t, num_out)


@triton.jit(**sizes_vary("T", "STRIDE_BT"))
def _select_all_kernel(
    # Pointers: lengths [T], token_to_req [T], block_table [B, nb]; outputs slots [T, K], lens [T]
    len_ptr, t2r_ptr, bt_ptr, out_ptr, lens_ptr,
    T,
    K: tl.constexpr, E: tl.constexpr, SLOTS_PER_BLOCK: tl.constexpr, SLOT_BASE: tl.constexpr,
    STRIDE_BT, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    req = tl.load(t2r_ptr + rows, mask=row_ok, other=-1)
    n = tl.load(len_ptr + rows, mask=row_ok, other=0)
    n = tl.where(req >= 0, tl.minimum(n, K), 0)
    bt_row = bt_ptr + tl.maximum(req, 0).to(tl.int64) * STRIDE_BT
    out_row = out_ptr + rows.to(tl.int64) * K
    for j0 in range(0, K, BLOCK_K):
        j = j0 + tl.arange(0, BLOCK_K)
        ok = j[None, :] < n[:, None]
        slot = _global_slots(bt_row[:, None], j[None, :], ok, E, SLOTS_PER_BLOCK, SLOT_BASE)
        tl.store(out_row[:, None] + j[None, :], slot, mask=row_ok[:, None] & (j < K)[None, :])
    tl.store(lens_ptr + rows, n, mask=row_ok)


def _check(lengths, token_to_req, block_table):
    assert lengths.shape == token_to_req.shape and lengths.dim() == 1
    assert token_to_req.dtype == torch.int32 and block_table.dtype == torch.int32
    assert block_table.stride(1) == 1


def indexer_topk(scores, lengths, k, token_to_req, block_table, entries_per_block, *,
                 slots_per_block=None, slot_base=0, radix=False):  # fmt: skip
    """scores [T, N] fp32, lengths [T] int32 (entries visible to each token), k, token_to_req
    [T] int32 (-1 = padding), block_table [B, nb] int32 -> (slots [T, k] int32 global slots of
    the top-k entries, -1 padded; lens [T] int32 = min(k, lengths), 0 for padding).
    `radix`: issue 25's threshold search (`_radix_threshold`; kernels/indexer_fused.py)."""
    _check(lengths, token_to_req, block_table)
    num_tokens, num_cols = scores.shape
    assert scores.dtype == torch.float32 and scores.stride(1) == 1
    slots = torch.empty(num_tokens, k, dtype=torch.int32, device=scores.device)
    lens = torch.empty(num_tokens, dtype=torch.int32, device=scores.device)
    if num_tokens == 0:
        return slots, lens
    block = min(triton.next_power_of_2(max(num_cols, 1)), _MAX_ROW_IN_REGISTERS)
    warps = 16 if block >= 8192 else (8 if block >= 2048 else 4)
    if radix:  # its one packed scan spills at 16 warps (128 registers) on sm_90; 8 do not
        warps = min(warps, 8)
    _topk_kernel[(num_tokens,)](
        scores, lengths, token_to_req, block_table, slots, lens, num_cols, scores.stride(0),
        K=k, E=entries_per_block, SLOTS_PER_BLOCK=slots_per_block or entries_per_block,
        SLOT_BASE=slot_base, STRIDE_BT=block_table.stride(0), BLOCK=block,
        BLOCK_K=min(triton.next_power_of_2(k), 1024), ONE_CHUNK=num_cols <= block,
        RADIX=radix, num_warps=warps,
    )  # fmt: skip
    return slots, lens


def indexer_select_all(lengths, k, token_to_req, block_table, entries_per_block, *,
                       slots_per_block=None, slot_base=0):  # fmt: skip
    """The #49486 path when every lengths[t] <= k: entries 0..n-1 as global slots, then -1.
    Same outputs as `indexer_topk` (rows longer than k keep their first k entries)."""
    _check(lengths, token_to_req, block_table)
    num_tokens = lengths.shape[0]
    slots = torch.empty(num_tokens, k, dtype=torch.int32, device=lengths.device)
    lens = torch.empty(num_tokens, dtype=torch.int32, device=lengths.device)
    if num_tokens == 0:
        return slots, lens
    block_k = min(triton.next_power_of_2(k), 1024)
    block_t = max(1, min(4096 // block_k, triton.next_power_of_2(num_tokens)))
    _select_all_kernel[(triton.cdiv(num_tokens, block_t),)](
        lengths, token_to_req, block_table, slots, lens, num_tokens,
        K=k, E=entries_per_block, SLOTS_PER_BLOCK=slots_per_block or entries_per_block,
        SLOT_BASE=slot_base, STRIDE_BT=block_table.stride(0), BLOCK_T=block_t, BLOCK_K=block_k,
        num_warps=4,
    )  # fmt: skip
    return slots, lens


# --------------------------------------------------------------------------- references


def _to_slots(local, token_to_req, block_table, entries_per_block, slots_per_block, slot_base):
    """local [T, k] int64 entry indices (-1 = none) -> global slots int32."""
    ok = local >= 0
    i = local.clamp(min=0)
    blk = block_table.long()[token_to_req.clamp(min=0).long()[:, None], i // entries_per_block]
    spb = slots_per_block or entries_per_block
    slots = blk * spb + slot_base + i % entries_per_block
    return torch.where(ok, slots, -1).to(torch.int32), ok.sum(dim=1).to(torch.int32)


def indexer_topk_ref(scores, lengths, k, token_to_req, block_table, entries_per_block, *,
                     slots_per_block=None, slot_base=0, radix=False):  # fmt: skip
    num_tokens, num_cols = scores.shape
    n = torch.where(token_to_req >= 0, lengths.long().clamp(max=num_cols), 0)
    available = torch.arange(num_cols, device=scores.device)[None, :] < n[:, None]
    masked = scores.masked_fill(~available, float("-inf"))  # as dsv4.model.indexer.indexer_topk
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]
    local = torch.where(available.gather(-1, order), order, -1)
    local = torch.cat([local, local.new_full((num_tokens, k - local.shape[1]), -1)], dim=1)
    return _to_slots(local, token_to_req, block_table, entries_per_block, slots_per_block,
                     slot_base)  # fmt: skip


def indexer_select_all_ref(lengths, k, token_to_req, block_table, entries_per_block, *,
                           slots_per_block=None, slot_base=0):  # fmt: skip
    n = torch.where(token_to_req >= 0, lengths.long().clamp(max=k), 0)
    j = torch.arange(k, device=lengths.device)
    local = torch.where(j[None, :] < n[:, None], j[None, :], -1)
    return _to_slots(local, token_to_req, block_table, entries_per_block, slots_per_block,
                     slot_base)  # fmt: skip


register_op("indexer_topk", indexer_topk, indexer_topk_ref, family="indexer")
register_op("indexer_select_all", indexer_select_all, indexer_select_all_ref, family="indexer")
