"""KV compressor step of the ratio-4 and ratio-128 layers (docs/model.md#compressor, #48957).

Every token t at position p brings a_t (`kv`) and z_t + ape[p % r] (`gate`), both [c*d'] fp32,
and saves the row [a_t | z_t] into its compressor-state ring slot. A token with (p+1) % r == 0
completes window i = (p+1)/r - 1, whose entry is the per-channel softmax over its candidates:
- ratio 128 (c = 1): the r tokens p-r+1..p, all d' channels;
- ratio 4 (c = 2, overlapping): channels [0, d') of the previous window's r tokens (missing for
  window 0: weight 0) and channels [d', 2d') of this window's r tokens.
The entry is then cast to bf16, RMS-normed with `norm_weight`, roped (interleaved pairs of the
last `rope_dim` channels, cos/sin at position r*i) and quantised into the cache entry format of
`dsv4.ops.kv_codec`: "fp8_ue8m0" (main compressor, 584 B for d' = 512), "mxfp4" (68 B) or
"fp8_fp32scale" (132 B) for the indexer's 128-d keys.

Two launches per step:
1. `_compress_kernel`, one program per BOUNDARY token only (a compact index list built on the
   host from host-known positions): online softmax over the candidates, norm, rope and the
   quantisation in registers, bytes stored at `entry_slots`. A candidate position that is part
   of this step (the last `num_in_step` positions of the request up to the boundary token) is
   read from `kv`/`gate`; older ones from the ring rows in `window_rows` ([NB, c*r]: rows of
   positions p-c*r+1..p, -1 where the position is < 0).
2. `_save_kernel` over all tokens: [a | z] into `state[save_slots]` (-1: not saved, e.g.
   padding or a position that a later token of the same step overwrites in the ring).
The compress launch runs first, so a long prefill chunk may reuse ring slots freely.
A decode step without a boundary token (127 of 128 steps at ratio 128) launches only the save;
`compressor_step_always` is the earlier approach (#48957's baseline): the compress kernel
launched over every token, with non-boundary programs exiting at once. The paged forward's glue
runs inside both launches (`ape`/`phase`: z + ape[p % r] at each read; `PagedAddress`: ring
slots and block-table columns to rows), where torch took ~7 launches per compressor call.

Roundings are emulated with integer ops (bf16 RNE, e4m3 RNE with saturation, power-of-two
scales from the exponent bits), so the bytes match the torch codecs on the GPU and under the
interpreter alike, up to the float differences of exp/rsqrt.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops.compressor import compress_windows
from dsv4.ops.kv_codec import encode_rows
from dsv4.ops.norm import rms_norm
from dsv4.ops.rope import apply_rope
from kernels.jit_helpers import bf16_rne, e4m3_bits, pow2, pow2_ceil_exp
from kernels.registry import register_op
from kernels.ring_offsets import PagedAddress, ring_row
from kernels.specialize import sizes_vary

FORMATS = ("fp8_ue8m0", "mxfp4", "fp8_fp32scale", "bf16", "fp32")  # the last two: debug caches


def entry_bytes(fmt: str, dim: int, rope_dim: int) -> int:
    """Bytes of one cache entry in `fmt` (docs/model.md#entry-formats)."""
    if fmt == "fp8_ue8m0":
        nope = dim - rope_dim
        return nope + 2 * rope_dim + (-(-nope // 64) + 7) // 8 * 8
    if fmt == "mxfp4":
        return dim // 2 + dim // 32
    if fmt == "fp8_fp32scale":
        return dim + 4
    if fmt in ("bf16", "fp32"):
        return dim * (2 if fmt == "bf16" else 4)
    raise ValueError(f"unknown compressor entry format {fmt!r}; use one of {FORMATS}")


@triton.jit
def _e2m1_bits(v):
    """fp32 (already divided by its scale) -> e2m1 nibble, ties rounding down as kv_codec."""
    m = tl.minimum(tl.abs(v), 6.0)
    idx = (m > 0.25).to(tl.int32) + (m > 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
    idx += (m > 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m > 3.5).to(tl.int32)
    idx += (m > 5.0).to(tl.int32)
    return idx | ((v < 0).to(tl.int32) << 3)


@triton.jit(**sizes_vary("num_reqs", "stride_bt"))
def _compress_kernel(
    # Inputs: kv, gate [T, W] fp32 (W = c*d', any row strides), positions [T], state ring
    # [S, 2W] fp32
    kv_ptr, gate_ptr, pos_ptr, state_ptr,
    # Per boundary b (per token in ALL_TOKENS mode): token index, in-step count, ring rows
    # [NB, NC], cos/sin [NB, ROPE/2], destination cache row; norm weight [D]
    bnd_ptr, nis_ptr, win_ptr, cos_ptr, sin_ptr, slot_ptr, w_ptr,
    # Output: cache [rows, >= entry bytes] uint8
    cache_ptr,
    # HAS_APE: ape [r, W] fp32 added to gate by each token's phase [T] (gate holds z alone)
    ape_ptr, phase_ptr,
    # PAGED (`PagedAddress`): ring_ids [B, NR] int64, block tables [B, nb], each program's
    # request [NB], entry rows [NB]; ring rows are ring slots, slot_ptr block-table columns
    ring_ptr, bt_ptr, req_ptr, erow_ptr,
    # Strides (elements / bytes) and scalars
    stride_kv, stride_gate, stride_state, stride_win, stride_cs, stride_cache, stride_ape, eps,
    num_reqs, stride_ring, rbi, epb, block_stride, offset_bytes, row_bytes,
    stride_bt, entry_stride, entry_unit, entry_base,
    # Meta-parameters
    D: tl.constexpr, ROPE: tl.constexpr, RATIO: tl.constexpr, OVERLAP: tl.constexpr,
    FMT: tl.constexpr,  # 0 fp8_ue8m0, 1 mxfp4, 2 fp8_fp32scale, 3 bf16, 4 fp32
    BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    ALL_TOKENS: tl.constexpr,  # baseline: one program per token, non-boundary ones idle
    HAS_APE: tl.constexpr, PAGED: tl.constexpr,
):  # fmt: skip
    NC: tl.constexpr = RATIO * (2 if OVERLAP else 1)  # candidates per entry
    W: tl.constexpr = D * (2 if OVERLAP else 1)
    b = tl.program_id(0)
    if ALL_TOKENS:
        tok = b
        active = (tl.load(pos_ptr + b) + 1) % RATIO == 0
    else:
        tok = tl.load(bnd_ptr + b)
        active = tok >= 0  # a -1 entry pads a fixed-size boundary list
    if active:
        ch = tl.arange(0, BLOCK_D)
        ch_ok = ch < D
        nis = tl.load(nis_ptr + b)
        if PAGED:
            req = tl.load(req_ptr + b)
        # ---- online softmax over the NC candidates, per channel --------------------------
        m = tl.full([BLOCK_D], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_D], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for c0 in tl.static_range(0, NC, BLOCK_C):
            j = c0 + tl.arange(0, BLOCK_C)
            back = NC - 1 - j  # distance from the boundary token
            in_step = back < nis
            row = tl.load(win_ptr + b.to(tl.int64) * stride_win + j, mask=~in_step, other=-1)
            if PAGED:  # ring slots [BLOCK_C] -> state rows
                row = ring_row(ring_ptr, req, row, num_reqs, stride_ring, rbi, epb,
                                block_stride, offset_bytes, row_bytes)  # fmt: skip
            in_ring = (~in_step) & (row >= 0)
            if OVERLAP:  # previous window: first halves; this window: second halves
                col = tl.where(j < RATIO, 0, D)[:, None] + ch[None, :]
            else:
                col = ch[None, :] + tl.zeros([BLOCK_C, 1], tl.int32)
            t_src = tl.maximum(tok - back, 0).to(tl.int64)
            r_src = tl.maximum(row, 0).to(tl.int64)
            mk_s = in_step[:, None] & ch_ok[None, :]
            mk_r = in_ring[:, None] & ch_ok[None, :]
            a = tl.load(kv_ptr + t_src[:, None] * stride_kv + col, mask=mk_s, other=0.0)
            a += tl.load(state_ptr + r_src[:, None] * stride_state + col, mask=mk_r, other=0.0)
            g_s = tl.load(gate_ptr + t_src[:, None] * stride_gate + col, mask=mk_s, other=0.0)
            if HAS_APE:  # z + ape[p % r]: the fp32 add the torch glue made
                ph = tl.load(phase_ptr + t_src, mask=in_step, other=0).to(tl.int64)
                g_s += tl.load(ape_ptr + ph[:, None] * stride_ape + col, mask=mk_s, other=0.0)
            g_r = tl.load(state_ptr + r_src[:, None] * stride_state + W + col, mask=mk_r,
                          other=0.0)  # fmt: skip
            g = tl.where(mk_s, g_s, tl.where(mk_r, g_r, float("-inf")))
            m_new = tl.maximum(m, tl.max(g, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(g - m_safe[None, :])
            alpha = tl.exp(m - m_safe)
            den = den * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p * a, axis=0)
            m = m_new
        x = bf16_rne(tl.where(ch_ok, acc / tl.where(ch_ok, den, 1.0), 0.0))
        # ---- RMSNorm (bf16 in and out, fp32 math) ----------------------------------------
        w = tl.load(w_ptr + ch, mask=ch_ok, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        y = bf16_rne(x * inv * w)
        # ---- RoPE on the last ROPE channels (pairs 2i, 2i+1) -----------------------------
        HALF: tl.constexpr = BLOCK_D // 2
        even, odd = tl.split(tl.reshape(y, [HALF, 2]))
        pair = tl.arange(0, HALF)
        ci = pair - (D - ROPE) // 2
        is_rope = (ci >= 0) & (pair < D // 2)
        cs_off = b.to(tl.int64) * stride_cs + tl.maximum(ci, 0)
        cos = tl.load(cos_ptr + cs_off, mask=is_rope, other=1.0)
        sin = tl.load(sin_ptr + cs_off, mask=is_rope, other=0.0)
        new_even = bf16_rne(even * cos - odd * sin)
        new_odd = bf16_rne(even * sin + odd * cos)
        y = tl.reshape(tl.join(new_even, new_odd), [BLOCK_D])
        # ---- quantise into the entry bytes ---------------------------------------------
        dst = tl.load(slot_ptr + b).to(tl.int64)
        if PAGED:  # block-table column -> token block -> cache row
            bt_row = tl.where(req < 0, req + num_reqs, req).to(tl.int64)  # -1: the last, as torch
            dst = tl.load(bt_ptr + bt_row * stride_bt + dst).to(tl.int64) * entry_stride
            dst += tl.load(erow_ptr + b).to(tl.int64) * entry_unit + entry_base
        out = cache_ptr + dst * stride_cache
        if FMT == 0:  # [nope e4m3 | rope bf16 | one UE8M0 byte per 64 nope dims, 8-padded]
            NOPE: tl.constexpr = D - ROPE
            NBLK: tl.constexpr = (NOPE + 63) // 64
            is_nope = ch < NOPE
            amax = tl.max(tl.reshape(tl.where(is_nope, tl.abs(y), 0.0), [BLOCK_D // 64, 64]), 1)
            e = pow2_ceil_exp(tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0))
            inv_s = tl.reshape(tl.broadcast_to(pow2(-e)[:, None], [BLOCK_D // 64, 64]), [BLOCK_D])
            codes = e4m3_bits(y * inv_s)
            tl.store(out + ch, codes.to(tl.uint8), mask=is_nope)
            hb = (y.to(tl.int32, bitcast=True) >> 16) & 0xFFFF
            rope_at = out + NOPE + 2 * (ch - NOPE)
            is_r = (ch >= NOPE) & ch_ok
            tl.store(rope_at, (hb & 0xFF).to(tl.uint8), mask=is_r)
            tl.store(rope_at + 1, (hb >> 8).to(tl.uint8), mask=is_r)
            g = tl.arange(0, BLOCK_D // 64)
            tl.store(out + NOPE + 2 * ROPE + g, (e + 127).to(tl.uint8), mask=g < NBLK)
            pad = NBLK + tl.arange(0, 8)
            tl.store(out + NOPE + 2 * ROPE + pad, tl.zeros([8], tl.uint8),
                     mask=pad < (NBLK + 7) // 8 * 8)  # fmt: skip
        elif FMT == 1:  # [D/2 packed e2m1, low nibble = even dim | D/32 UE8M0]
            amax = tl.max(tl.reshape(tl.where(ch_ok, tl.abs(y), 0.0), [BLOCK_D // 32, 32]), 1)
            e = pow2_ceil_exp(tl.math.div_rn(tl.maximum(amax, 1e-12), 6.0))
            inv_s = tl.reshape(tl.broadcast_to(pow2(-e)[:, None], [BLOCK_D // 32, 32]), [BLOCK_D])
            lo, hi = tl.split(tl.reshape(_e2m1_bits(y * inv_s), [HALF, 2]))
            tl.store(out + pair, (lo | (hi << 4)).to(tl.uint8), mask=pair < D // 2)
            g = tl.arange(0, BLOCK_D // 32)
            tl.store(out + D // 2 + g, (e + 127).to(tl.uint8), mask=g < D // 32)
        elif FMT == 3:  # the bf16 row (debug caches)
            hb = (y.to(tl.int32, bitcast=True) >> 16) & 0xFFFF
            tl.store(out + 2 * ch, (hb & 0xFF).to(tl.uint8), mask=ch_ok)
            tl.store(out + 2 * ch + 1, (hb >> 8).to(tl.uint8), mask=ch_ok)
        elif FMT == 4:  # the (bf16-valued) fp32 row
            bits = y.to(tl.int32, bitcast=True)
            for k in tl.static_range(4):
                tl.store(out + 4 * ch + k, ((bits >> (8 * k)) & 0xFF).to(tl.uint8), mask=ch_ok)
        else:  # [D e4m3 | fp32 scale = amax / 448]
            amax = tl.max(tl.where(ch_ok, tl.abs(y), 0.0), axis=0)
            scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1e-12)
            codes = e4m3_bits(tl.math.div_rn(y, scale))
            tl.store(out + ch, codes.to(tl.uint8), mask=ch_ok)
            k = tl.arange(0, 4)
            sb = (scale.to(tl.int32, bitcast=True) >> (8 * k)) & 0xFF
            tl.store(out + D + k, sb.to(tl.uint8))


@triton.jit(**sizes_vary("T", "num_reqs"))
def _save_kernel(
    # [a | z (+ ape[phase] if HAS_APE)] of every token into its ring row (slot -1: skip);
    # PAGED: slots are ring slots of the token's request [T] (`_compress_kernel`'s arguments)
    kv_ptr, gate_ptr, slots_ptr, state_ptr, ape_ptr, phase_ptr, ring_ptr, treq_ptr,
    T, W, stride_kv, stride_gate, stride_state, stride_ape,
    num_reqs, stride_ring, rbi, epb, block_stride, offset_bytes, row_bytes,
    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, HAS_APE: tl.constexpr, PAGED: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slots_ptr + rows, mask=rows < T, other=-1)
    if PAGED:
        req = tl.load(treq_ptr + rows, mask=rows < T, other=0)
        slot = ring_row(ring_ptr, req, slot, num_reqs, stride_ring, rbi, epb, block_stride,
                         offset_bytes, row_bytes)  # fmt: skip
    ok = slot >= 0
    if HAS_APE:
        ph = tl.load(phase_ptr + rows, mask=ok, other=0).to(tl.int64)[:, None]
    src = rows.to(tl.int64)[:, None]
    dst = state_ptr + tl.maximum(slot, 0).to(tl.int64)[:, None] * stride_state
    for w0 in range(0, W, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        mk = ok[:, None] & (w < W)[None, :]
        a = tl.load(kv_ptr + src * stride_kv + w[None, :], mask=mk)
        tl.store(dst + w[None, :], a, mask=mk)
        z = tl.load(gate_ptr + src * stride_gate + w[None, :], mask=mk)
        if HAS_APE:
            z += tl.load(ape_ptr + ph * stride_ape + w[None, :], mask=mk)
        tl.store(dst + W + w[None, :], z, mask=mk)


def _check(kv, gate, state, cache, ratio, fmt, dim, rope_dim):
    assert ratio > 1, ratio
    assert kv.dtype == gate.dtype == state.dtype == torch.float32 and cache.dtype == torch.uint8
    assert kv.shape == gate.shape and kv.stride(1) == gate.stride(1) == 1
    assert state.shape[1] == 2 * kv.shape[1] and state.stride(1) == 1 and cache.stride(1) == 1
    assert rope_dim % 2 == 0 and (dim - rope_dim) % 2 == 0
    assert cache.shape[1] >= entry_bytes(fmt, dim, rope_dim), (cache.shape, fmt)


def _options(kv, ape, phase, paged):
    """Kernel arguments of the optional glue, dummies (never read) where it is off:
    ((ape, phase, stride_ape, HAS_APE), (ring_ids, num_reqs and the ring scalars), PAGED)."""
    if ape is None:
        ape_args = (kv, kv, 0, False)
    else:
        assert ape.dtype == torch.float32 and ape.stride(1) == 1 and ape.shape[1] == kv.shape[1]
        assert phase is not None and phase.shape == kv.shape[:1], (phase, kv.shape)
        ape_args = (ape, phase, ape.stride(0), True)
    if paged is None:
        return ape_args, (kv, 0, 0, 0, 1, 0, 0, 0), False
    ring, bt = paged.ring_ids, paged.block_tables
    assert ring.dtype == torch.int64 and ring.stride(1) == 1 and bt.stride(1) == 1
    assert bt.shape[0] == ring.shape[0], (bt.shape, ring.shape)
    assert paged.token_reqs.shape == kv.shape[:1], (paged.token_reqs.shape, kv.shape)
    ring_args = (ring, ring.shape[0], ring.stride(0), paged.ring_block_index,
                 paged.entries_per_block, paged.block_stride, paged.offset_bytes,
                 paged.entry_bytes)  # fmt: skip
    return ape_args, ring_args, True


def _launch_compress(kv, gate, positions, state, bnd, nis, window_rows, norm_weight, cos, sin,
                     cache, entry_slots, n, ratio, fmt, rope_dim, eps, all_tokens, paged,
                     opts):  # fmt: skip
    overlap = ratio == 4
    dim = kv.shape[1] // (2 if overlap else 1)
    block_d = max(64, triton.next_power_of_2(dim))
    num_cand = ratio * (2 if overlap else 1)
    block_c = min(num_cand, max(1, 4096 // block_d))
    window_rows = window_rows.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    (ape, phase, stride_ape, has_ape), (ring, *ring_scalars), on = opts
    bt, reqs, erows = (paged.block_tables, paged.reqs, paged.entry_rows) if on else (bnd,) * 3
    entry = ((paged.block_tables.stride(0), paged.entry_stride, paged.entry_unit,
              paged.entry_base) if on else (0, 1, 1, 0))  # fmt: skip
    _compress_kernel[(n,)](
        kv, gate, positions, state,
        bnd, nis, window_rows, cos, sin, entry_slots, norm_weight,
        cache, ape, phase, ring, bt, reqs, erows,
        kv.stride(0), gate.stride(0), state.stride(0), window_rows.stride(0), cos.stride(0),
        cache.stride(0), stride_ape, float(eps), *ring_scalars, *entry,
        D=dim, ROPE=rope_dim, RATIO=ratio, OVERLAP=overlap, FMT=FORMATS.index(fmt),
        BLOCK_D=block_d, BLOCK_C=block_c, ALL_TOKENS=all_tokens, HAS_APE=has_ape, PAGED=on,
        num_warps=8 if block_d >= 512 else 4,
    )  # fmt: skip


def _launch_save(kv, gate, state, save_slots, paged, opts):
    num_tokens, width = kv.shape
    if num_tokens == 0:
        return
    (ape, phase, stride_ape, has_ape), (ring, *ring_scalars), on = opts
    block_w = min(triton.next_power_of_2(width), 1024 if kv.is_cuda else 4096)
    block_t = max(1, min(triton.next_power_of_2(num_tokens), 4096 // block_w))
    _save_kernel[(triton.cdiv(num_tokens, block_t),)](
        kv, gate, save_slots, state, ape, phase, ring, paged.token_reqs if on else save_slots,
        num_tokens, width, kv.stride(0), gate.stride(0), state.stride(0), stride_ape,
        *ring_scalars, BLOCK_T=block_t, BLOCK_W=block_w, HAS_APE=has_ape, PAGED=on,
    )  # fmt: skip


def compressor_step(kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor,
                    state: torch.Tensor, save_slots: torch.Tensor, boundary: torch.Tensor,
                    num_in_step: torch.Tensor, window_rows: torch.Tensor,
                    norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    cache: torch.Tensor, entry_slots: torch.Tensor, *, ratio: int, fmt: str,
                    rope_dim: int, eps: float = 1e-6, entry_dtype: torch.dtype = torch.bfloat16,
                    ape: torch.Tensor | None = None, phase: torch.Tensor | None = None,
                    paged: PagedAddress | None = None) -> torch.Tensor:  # fmt: skip
    """One step of a compressor: entries of the boundary tokens into `cache`, then the state.

    kv, gate [T, c*d'] fp32, unit column stride, any row stride (e.g. the two halves of one
    [T, 2 c d'] projection); positions [T]; state [S, 2*c*d'] fp32 ring rows; save_slots [T]
    int32 (ring row per token, -1 = skip). Per boundary token b (NB of them, NB may be 0):
    boundary [NB] int32 token index, num_in_step [NB] int32 (tokens of its request in this
    step up to and including it), window_rows [NB, c*r] int32 (ring rows of positions
    p-c*r+1..p, -1 if < 0; read only where not in this step), cos/sin [NB, rope/2] fp32 at
    position p+1-r, entry_slots [NB] int32 (row of `cache`). norm_weight [d'];
    cache [rows, >= entry_bytes(fmt)] uint8. Returns `cache` (written in place).

    Glue done in the kernels (each launch of its own in torch): with `ape` [r, c*d'] fp32 and
    `phase` [T] int (p mod r), gate holds z alone and every read adds ape[phase] (the same
    fp32 add); with `paged`, save_slots / window_rows are ring slots and entry_slots columns
    of the programs' block tables, addressed as `PagedAddress.resolve` does.
    """
    dim = kv.shape[1] // (2 if ratio == 4 else 1)
    _check(kv, gate, state, cache, ratio, fmt, dim, rope_dim)
    assert entry_dtype == torch.bfloat16, "the kernel rounds entries to bf16 (the served dtype)"
    opts = _options(kv, ape, phase, paged)
    num_b = boundary.shape[0]
    if num_b:  # #48957: no compress launch on a step without a boundary token
        _launch_compress(kv, gate, positions, state, boundary, num_in_step, window_rows,
                         norm_weight, cos, sin, cache, entry_slots, num_b, ratio, fmt, rope_dim,
                         eps, False, paged, opts)  # fmt: skip
    _launch_save(kv, gate, state, save_slots, paged, opts)
    return cache


def compressor_step_always(kv, gate, positions, state, save_slots, boundary, num_in_step,
                           window_rows, norm_weight, cos, sin, cache, entry_slots, *, ratio,
                           fmt, rope_dim, eps=1e-6, entry_dtype=torch.bfloat16, ape=None,
                           phase=None, paged=None):  # fmt: skip
    """The pre-#48957 slow path: the compress kernel over EVERY token (per-token tables:
    num_in_step [T], window_rows [T, c*r], cos/sin [T, rope/2], entry_slots [T]; `paged.reqs`
    and `paged.entry_rows` [T]), non-boundary programs idle; `boundary` is ignored. Then the
    state save."""
    dim = kv.shape[1] // (2 if ratio == 4 else 1)
    _check(kv, gate, state, cache, ratio, fmt, dim, rope_dim)
    opts = _options(kv, ape, phase, paged)
    if kv.shape[0]:
        _launch_compress(kv, gate, positions, state, boundary, num_in_step, window_rows,
                         norm_weight, cos, sin, cache, entry_slots, kv.shape[0], ratio, fmt,
                         rope_dim, eps, True, paged, opts)  # fmt: skip
    _launch_save(kv, gate, state, save_slots, paged, opts)
    return cache


def _glue_ref(gate, save_slots, window_rows, entry_slots, ape, phase, paged):
    """The torch form of the kernels' optional glue (module doc of `compressor_step`)."""
    if ape is not None:
        gate = gate + ape[phase.long()]  # [T, c d'] fp32
    if paged is not None:
        save_slots, window_rows, entry_slots = paged.resolve(save_slots, window_rows, entry_slots)
    return gate, save_slots, window_rows, entry_slots


def compressor_step_ref(
    kv, gate, positions, state, save_slots, boundary, num_in_step, window_rows, norm_weight,
    cos, sin, cache, entry_slots, ratio=4, fmt="fp8_ue8m0", rope_dim=64, eps=1e-6,
    entry_dtype=torch.bfloat16, ape=None, phase=None, paged=None,
):  # fmt: skip
    """Reference: gathers each boundary window from the step and the ring, then the model's
    `compress_windows`, RMSNorm and `apply_rope` in `entry_dtype` (the model dtype: bf16, as
    the kernel; fp32 for exactness tests of an fp32 model) and `kv_codec.encode_rows`."""
    gate, save_slots, window_rows, entry_slots = _glue_ref(gate, save_slots, window_rows,
                                                           entry_slots, ape, phase, paged)  # fmt: skip
    overlap = ratio == 4
    width = kv.shape[1]
    dim = width // (2 if overlap else 1)
    num_cand = ratio * (2 if overlap else 1)
    if boundary.numel():
        j = torch.arange(num_cand, device=kv.device)
        back = (num_cand - 1 - j)[None, :]  # [1, NC]
        in_step = back < num_in_step.long()[:, None]  # [NB, NC]
        tok = (boundary.long()[:, None] - back).clamp_min(0)
        row = window_rows.long()
        ring = _rows_at(state, row.clamp_min(0))  # [NB, NC, 2W]
        cand_kv = torch.where(in_step[..., None], kv[tok], ring[..., :width])
        cand_gate = torch.where(in_step[..., None], gate[tok], ring[..., width:])
        missing = (~in_step & (row < 0))[..., None]
        cand_kv = cand_kv.masked_fill(missing, 0.0)
        cand_gate = cand_gate.masked_fill(missing, float("-inf"))
        windows = compress_windows  # the model's math, never a swapped kernel
        if overlap:  # [prev_b, cur_b] pairs; the odd outputs are the boundary entries
            n = boundary.numel()
            kv_w = cand_kv.view(n * 2, ratio, width)
            gate_w = cand_gate.view(n * 2, ratio, width)
            new = windows(kv_w, gate_w, None, None, True)[1::2]
        else:
            new = windows(cand_kv, cand_gate, None, None, False)
        new = rms_norm(new.to(entry_dtype), norm_weight, eps)
        new = apply_rope(new, cos, sin)
        records = encode_rows(new, fmt, entry_bytes(fmt, dim, rope_dim), rope_dim)
        _set_rows(cache, entry_slots.long(), records)
    keep = save_slots >= 0
    _set_rows(state, save_slots[keep].long(), torch.cat((kv, gate), dim=1)[keep])
    return cache


def compressor_step_always_ref(kv, gate, positions, state, save_slots, boundary, num_in_step,
                               window_rows, norm_weight, cos, sin, cache, entry_slots, *, ratio,
                               fmt, rope_dim, eps=1e-6, entry_dtype=torch.bfloat16, ape=None,
                               phase=None, paged=None):  # fmt: skip
    """Reference of `compressor_step_always` (per-token tables, `boundary` ignored): the tokens
    that close a window are picked on the device (a host sync: CPU and tests only)."""
    gate, save_slots, window_rows, entry_slots = _glue_ref(gate, save_slots, window_rows,
                                                           entry_slots, ape, phase, paged)  # fmt: skip
    closes = ((positions.long() + 1) % ratio == 0).nonzero().squeeze(1)
    return compressor_step_ref(
        kv, gate, positions, state, save_slots, closes.int(), num_in_step[closes],
        window_rows[closes], norm_weight, cos[closes], sin[closes], cache, entry_slots[closes],
        ratio=ratio, fmt=fmt, rope_dim=rope_dim, eps=eps, entry_dtype=entry_dtype,
    )  # fmt: skip


def _flat_index(view: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
    """Storage element offsets [*rows.shape, width] of `view[rows, :width]`. Callers may pass
    row-addressed views whose rows overlap (stride (1, 1): row = element offset), which torch's
    indexing cannot write into, so the references go through the flat storage."""
    cols = torch.arange(width, device=view.device) * view.stride(1)
    return view.storage_offset() + rows.unsqueeze(-1) * view.stride(0) + cols


def _storage(view: torch.Tensor) -> torch.Tensor:
    numel = view.untyped_storage().nbytes() // view.element_size()
    return view.as_strided((numel,), (1,), 0)


def _rows_at(view: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return _storage(view)[_flat_index(view, rows, view.shape[1])]


def _set_rows(view: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    _storage(view)[_flat_index(view, rows, values.shape[1])] = values.to(view.dtype)


register_op("compressor_step", compressor_step, compressor_step_ref, family="compressor",
            baseline_fn=compressor_step_always)  # fmt: skip
