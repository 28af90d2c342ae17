"""Lightning-indexer logits over the paged indexer-key cache (docs/model.md#lightning-indexer).

For a batched decode (or prefill) step of T query tokens, token t belongs to request
`token_to_req[t]` (-1 = padding) and sees that request's compressed entries i < lengths[t]:

    scores[t, i] = sum_h w[t, h] * relu(q[t, h] . k_i)        (-inf for i >= lengths[t])

with k_i the request's indexer key i, row `i % E` of token block `block_table[req][i // E]`.
The keys are read in place from a paged view of the cache, `keys [num_blocks, E, row]` (a
per-layer `as_strided` view of the one `[num_blocks, block_stride]` backing: block stride =
block_stride bytes, row stride = row bytes), in one of the formats of `kv_codec`:
- "fp8_fp32scale": [d e4m3 | fp32 scale] (132 B for d = 128);
- "mxfp4": [d/2 packed e2m1, low nibble = even dim | d/32 UE8M0] (68 B);
- "plain": float rows [num_blocks, E, d] (bf16 / fp32; tests and debug caches).
Block and row strides, E and the format are compile-time constants (#51967).

Kernel: one program per (token, split of the key range); all H_I = 64 heads of the token are
the N side of one [BLOCK_N keys, d] x [d, 64 heads] tensor-core GEMM per key block. Keys are
dequantised in registers exactly (e4m3 codes and e2m1 x 2^k are bf16-exact); the FP8 row scale
is applied to the dot product afterwards, so nothing but q is rounded. relu, the head weights
and the head sum are fused; each key byte is read once from HBM. The top-k over these scores is
`kernels.indexer_select`.

`indexer_logits_ref` gathers the rows, decodes them with `kv_codec.decode_rows` and applies
`dsv4.model.indexer.indexer_scores` batched over the tokens.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dsv4.ops.kv_codec import decode_rows
from kernels.jit_helpers import token_request
from kernels.registry import register_op
from kernels.specialize import sizes_vary

KEY_FORMATS = {"plain": 0, "fp8_fp32scale": 1, "mxfp4": 2}
_SPLIT_ALIGN = 256  # split boundaries are multiples of every BLOCK_N


@triton.jit
def _load_keys(key_ptr, base, ok, DI: tl.constexpr, FMT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows at byte/element offsets `base` [BLOCK_N] -> ([BLOCK_N, DI] fp32, [BLOCK_N] row scale)."""
    if FMT == 0:  # plain float rows
        d = tl.arange(0, DI)
        k = tl.load(key_ptr + base[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        return k.to(tl.float32), tl.full([BLOCK_N], 1.0, tl.float32)
    elif FMT == 1:  # e4m3 codes, one fp32 scale per row applied after the dot
        d = tl.arange(0, DI)
        codes = tl.load(key_ptr + base[:, None] + d[None, :], mask=ok[:, None], other=0)
        scale_ptr = (key_ptr + base + DI).to(tl.pointer_type(tl.float32))
        scale = tl.load(scale_ptr, mask=ok, other=0.0)
        return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32), scale
    else:  # MXFP4: two e2m1 nibbles per byte (low = even dim), one UE8M0 per 32 dims
        j = tl.arange(0, DI // 2)
        packed = tl.load(key_ptr + base[:, None] + j[None, :], mask=ok[:, None], other=0)
        packed = packed.to(tl.int32)
        nib = tl.reshape(tl.join(packed & 15, packed >> 4), (BLOCK_N, DI))
        e = (nib >> 1) & 3
        m = (nib & 1).to(tl.float32)
        mag = tl.where(e == 0, 0.5 * m, (2.0 + m) * (1 << e).to(tl.float32) * 0.25)
        val = tl.where((nib & 8) != 0, -mag, mag)
        b = tl.arange(0, DI // 32)
        sb = tl.load(key_ptr + base[:, None] + DI // 2 + b[None, :], mask=ok[:, None], other=127)
        scale = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(sb-127)
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, DI // 32, 32)),
                           (BLOCK_N, DI))  # fmt: skip
        return val * scale, tl.full([BLOCK_N], 1.0, tl.float32)


@triton.jit
def _load_keys_fast(key_ptr, base, ok, DI: tl.constexpr, FMT: tl.constexpr, DOT_T: tl.constexpr,
                    BLOCK_N: tl.constexpr):  # fmt: skip
    """The FAST variant's rows -> [BLOCK_N, DI] in the dot dtype (the FP8 row scale is not
    applied: the kernel multiplies the head sum by it). e4m3 -> fp16 is one cvt per two codes;
    an e2m1 nibble x = s e1 e0 m placed as fp32 bits (x & 7) << 22 (sign to bit 31) is
    e2m1(x) * 2^-126 exactly (x = 1 is the subnormal 2^-127): times 2^126, times the block's
    2^(s-127), a few integer ops a value instead of `_load_keys`' float select chain."""
    if FMT == 2:
        j = tl.arange(0, DI // 2)
        p = tl.load(key_ptr + base[:, None] + j[None, :], mask=ok[:, None], other=0).to(tl.int32)
        lo = ((p & 7) << 22) | ((p & 8) << 28)  # even dim: the low nibble
        hi = ((p & 0x70) << 18) | ((p & 0x80) << 24)
        bits = tl.reshape(tl.join(lo, hi), (BLOCK_N, DI))
        b = tl.arange(0, DI // 32)
        sb = tl.load(key_ptr + base[:, None] + DI // 2 + b[None, :], mask=ok[:, None], other=127)
        scale = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(sb-127)
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, DI // 32, 32)),
                           (BLOCK_N, DI))  # fmt: skip
        val = bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # x 2^126
        return (val * scale).to(DOT_T)
    else:
        d = tl.arange(0, DI)
        k = tl.load(key_ptr + base[:, None] + d[None, :], mask=ok[:, None], other=0)
        if FMT == 1:
            k = k.to(tl.float8e4nv, bitcast=True)
        return k.to(DOT_T)


@triton.jit(**sizes_vary("N", "split_len", "STRIDE_BT"))
def _logits_kernel(
    # Pointers: q [T, HI, DI], weights [T, HI] fp32, keys [num_blocks, E, row] (paged view),
    # block_table [B, nb] int32, token_to_req [T] int32, lengths [T] int32; out scores [T, N] fp32
    q_ptr, w_ptr, key_ptr, bt_ptr, t2r_ptr, len_ptr, out_ptr,
    # Sizes, strides (elements), scalars
    N, stride_qt, stride_qh, stride_wt, stride_ot, split_len,
    # Compile-time shape, strides and format (fixed per serving config)
    HI: tl.constexpr, DI: tl.constexpr, E: tl.constexpr, STRIDE_KB: tl.constexpr,
    STRIDE_KE: tl.constexpr, STRIDE_BT, FMT: tl.constexpr,
    DOT_BF16: tl.constexpr,  # bf16 tensor-core dot (GPU); fp32 under the interpreter
    WRITE_TAIL: tl.constexpr,  # -inf past the visible entries (False: the top-k never reads them)
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FAST: tl.constexpr = False,  # issue 25's variant: `_load_keys_fast`, fp16 dot for FP8 keys
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    bt_row, n = token_request(t2r_ptr, len_ptr, bt_ptr, t, N, STRIDE_BT)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, DI)
    dot_t = tl.bfloat16 if DOT_BF16 else tl.float32
    if FAST and DOT_BF16 and FMT == 1:
        dot_t = tl.float16  # e4m3 codes are fp16 values; bf16 q is fp16 for 2^-14 <= |q| <= 65504
    q = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :],
                mask=(h < HI)[:, None], other=0.0).to(tl.float32).to(dot_t)  # fmt: skip
    w = tl.load(w_ptr + t * stride_wt + h, mask=h < HI, other=0.0).to(tl.float32)
    out_row = out_ptr + t * stride_ot
    start = tl.program_id(1) * split_len
    end = tl.minimum(start + split_len, N)
    stop = tl.minimum(end, n)
    for i0 in range(start, stop, BLOCK_N):
        i = i0 + tl.arange(0, BLOCK_N)
        ok = i < stop
        blk = tl.load(bt_row + i // E, mask=ok, other=0).to(tl.int64)
        base = blk * STRIDE_KB + (i % E) * STRIDE_KE
        if FAST:
            dots = tl.dot(_load_keys_fast(key_ptr, base, ok, DI, FMT, dot_t, BLOCK_N), tl.trans(q))
            score = tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1)
            if FMT == 1:  # the row scale (> 0) after relu and the head sum: relu(s d) = s relu(d)
                score *= tl.load((key_ptr + base + DI).to(tl.pointer_type(tl.float32)), mask=ok,
                                 other=0.0)  # fmt: skip
        else:
            k, row_scale = _load_keys(key_ptr, base, ok, DI, FMT, BLOCK_N)
            dots = tl.dot(k.to(dot_t), tl.trans(q)) * row_scale[:, None]  # [BLOCK_N, BLOCK_H]
            score = tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1)
        tl.store(out_row + i, tl.where(ok, score, float("-inf")), mask=i < end)
    if WRITE_TAIL:  # the rest of this split is past the visible entries
        tail = start + tl.cdiv(tl.maximum(stop - start, 0), BLOCK_N) * BLOCK_N
        for i0 in range(tail, end, BLOCK_N):
            i = i0 + tl.arange(0, BLOCK_N)
            tl.store(out_row + i, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=i < end)


_GPU_CONFIGS = [(128, 8, 3), (128, 4, 3), (64, 4, 4), (256, 8, 2)]  # BLOCK_N, warps, stages


@functools.cache
def _tuned_logits_kernel():
    configs = [
        triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s) for bn, w, s in _GPU_CONFIGS
    ]
    return triton.autotune(configs, key=["HI", "DI", "E", "FMT", "DOT_BF16", "FAST"])(
        _logits_kernel
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _key_geometry(keys, key_format, head_dim):
    """(row stride, block stride, format id) of the paged key view, checked."""
    fmt = KEY_FORMATS[key_format]
    assert keys.dim() == 3 and keys.stride(2) == 1
    if fmt == 0:
        assert keys.shape[2] == head_dim and keys.dtype in (torch.float32, torch.bfloat16)
    else:
        assert keys.dtype == torch.uint8
        need = head_dim + 4 if fmt == 1 else head_dim // 2 + head_dim // 32
        assert keys.shape[2] >= need, f"{key_format} rows need {need} bytes"
        if fmt == 1:
            assert keys.stride(0) % 4 == 0 and keys.stride(1) % 4 == 0, "fp32 scale alignment"
    return keys.stride(1), keys.stride(0), fmt


def indexer_logits(q, weights, keys, block_table, token_to_req, lengths, *, key_format,
                   num_cols=None, write_tail=True, fast=False):  # fmt: skip
    """q [T, H_I, d] bf16/fp32, weights [T, H_I] fp32 (already scaled), keys: paged view
    [num_blocks, E, row] (uint8 rows, or [num_blocks, E, d] float for "plain"), block_table
    [B, nb] int32, token_to_req [T] int32 (-1 = padding), lengths [T] int32 (visible entries)
    -> scores [T, num_cols] fp32, -inf at i >= lengths[t].

    `num_cols` (the static width, e.g. max_model_len // 4) defaults to max(lengths): a host sync.
    `write_tail=False` leaves scores[t, i >= lengths[t]] unwritten (the top-k reads only
    i < lengths[t]): a static width then costs nothing past each row's visible entries.
    `fast`: issue 25's variant of the inner loop (`_load_keys_fast`; kernels/indexer_fused.py)."""
    num_tokens, num_heads, head_dim = q.shape
    assert head_dim & (head_dim - 1) == 0 and head_dim >= 32 and q.stride(2) == 1
    assert weights.shape == (num_tokens, num_heads) and weights.stride(1) == 1
    assert block_table.dtype == torch.int32 and block_table.stride(1) == 1
    assert token_to_req.shape == lengths.shape == (num_tokens,)
    stride_row, stride_block, fmt = _key_geometry(keys, key_format, head_dim)
    if num_cols is None:
        num_cols = int(lengths.max()) if num_tokens else 0
    # rows padded to 16 columns: the row stride keeps one "divisible by 16" class (vectorised
    # stores) whatever the step's visible entries (kernels/specialize.py)
    out = torch.empty(num_tokens, -(-num_cols // 16) * 16, dtype=torch.float32, device=q.device)
    out = out[:, :num_cols]
    if num_tokens == 0 or num_cols == 0:
        return out
    on_gpu = q.is_cuda
    if on_gpu:  # ~4 waves of programs; each split a multiple of every BLOCK_N
        target = triton.cdiv(4 * _num_sms(q.device.index or 0), num_tokens)
        split_len = max(triton.cdiv(num_cols, target), 4 * _SPLIT_ALIGN)
        split_len = triton.cdiv(split_len, _SPLIT_ALIGN) * _SPLIT_ALIGN
    else:
        split_len = triton.cdiv(num_cols, 2)  # two splits: the tail path is exercised too
    args = (q, weights, keys, block_table, token_to_req, lengths, out, num_cols, q.stride(0),
            q.stride(1), weights.stride(0), out.stride(0), split_len)  # fmt: skip
    meta = dict(HI=num_heads, DI=head_dim, E=keys.shape[1], STRIDE_KB=stride_block,
                STRIDE_KE=stride_row, STRIDE_BT=block_table.stride(0), FMT=fmt,
                DOT_BF16=on_gpu and q.dtype == torch.bfloat16, WRITE_TAIL=write_tail,
                BLOCK_H=max(16, triton.next_power_of_2(num_heads)), FAST=fast)  # fmt: skip
    grid = (num_tokens, triton.cdiv(num_cols, split_len))
    if on_gpu:
        _tuned_logits_kernel()[grid](*args, **meta)
    else:
        _logits_kernel[grid](*args, **meta, BLOCK_N=triton.next_power_of_2(split_len))
    return out


def indexer_logits_ref(q, weights, keys, block_table, token_to_req, lengths, *, key_format,
                       num_cols=None, write_tail=True, fast=False):  # fmt: skip
    num_tokens, _, head_dim = q.shape
    if num_cols is None:
        num_cols = int(lengths.max()) if num_tokens else 0
    entries = keys.shape[1]
    i = torch.arange(num_cols, device=q.device)
    n = torch.where(token_to_req >= 0, lengths.long().clamp(max=num_cols), 0)
    visible = i[None, :] < n[:, None]  # [T, N]
    col = (i // entries).clamp(max=block_table.shape[1] - 1)
    blk = block_table.long()[token_to_req.clamp(min=0).long()[:, None], col[None, :]]
    rows = keys[torch.where(visible, blk, 0), i % entries]  # [T, N, row]
    if key_format == "plain":
        k = rows.float()
    else:
        flat = rows.reshape(-1, rows.shape[-1])
        k = decode_rows(flat, key_format, head_dim, 0).view(num_tokens, num_cols, head_dim)
    # indexer_scores (dsv4.model.indexer) batched over tokens
    dots = torch.einsum("thd,tnd->thn", q.float(), k).relu()  # [T, H_I, N]
    scores = (dots * weights.float().unsqueeze(-1)).sum(dim=1)
    return scores.masked_fill(~visible, float("-inf"))


register_op("indexer_logits", indexer_logits, indexer_logits_ref, family="indexer")
