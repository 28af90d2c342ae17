"""`@triton.jit` helpers that more than one kernel module calls (one home, no kernel module
imports another for them): bf16 / e4m3 / power-of-two bit tricks, the KV cache's fp8 blocks
(kernels/kv_store.py and kv_workspace.py encode and decode them alike), the e2m1 decode, the
grouped tile order of the GEMMs and the FP8 linears' split-K epilogue (store_split: the
partials stored for a reduce launch, or added in-launch by the tile's last program, whose
counters and REDUCE knob are in kernels/fp8_splitk.py)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def bf16_rne(x):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def swiglu_bf16(acc_g, acc_u, limit, HAS_LIMIT: tl.constexpr):
    """h = bf16(silu(min(g, limit)) * clamp(u, -limit, limit)) from the fp32 gate and up sums,
    each rounded to bf16 first: `dsv4.ops.moe.swiglu`'s roundings (F.linear's bf16 outputs),
    the one definition the MoE GEMM, GEMV and W4A8 kernels share. Any shape, fp32 holding bf16."""
    g = bf16_rne(acc_g)
    u = bf16_rne(acc_u)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    return bf16_rne(g / (1.0 + tl.exp(-g)) * u)


@triton.jit
def pow2_ceil_exp(ratio):
    """ceil(log2(ratio)) for positive normal fp32 values, from the exponent bits."""
    bits = ratio.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return tl.minimum(tl.maximum(e, -126), 127)


@triton.jit
def pow2(e):
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits(v):
    """fp32 -> float8_e4m3fn byte (RNE, saturating at 448) as int32."""
    bits = v.to(tl.int32, bitcast=True)
    a = tl.minimum(tl.abs(v), 448.0)
    t = a * 512.0  # subnormals: steps of 2^-9
    r = tl.floor(t)
    frac = t - r
    ri = r.to(tl.int32)
    sub = ri + ((frac > 0.5) | ((frac == 0.5) & ((ri & 1) == 1))).to(tl.int32)
    ab = a.to(tl.int32, bitcast=True)
    normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - 960
    code = tl.where(a < 0.015625, sub, tl.minimum(normal, 126))
    return code | (((bits >> 31) & 1) << 7)


@triton.jit
def kv_fp8_encode(x):
    """KV nope blocks x [N, BLOCK_C, 64] fp32 (kernels/kv_store.py's fp8_ue8m0) -> (e4m3 codes
    [N, BLOCK_C, 64] int32 in 0..255, exponents e [N, BLOCK_C] int32: scale 2^e, stored as the
    UE8M0 byte e + 127; 2^ceil(log2(max(amax, 1e-4) / 448)) per block)."""
    amax = tl.max(tl.abs(x), axis=2)  # [N, BLOCK_C]
    e = pow2_ceil_exp(tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0))
    return e4m3_bits(x * pow2(-e)[:, :, None]), e


@triton.jit
def kv_fp8_decode(codes, e):
    """`kv_fp8_encode`'s inverse: e4m3 codes [N, BLOCK_C, 64] uint8, UE8M0 bytes e [N, BLOCK_C]
    int32 -> fp32 values code * 2^(e - 127) (0 where e is 0: masked scales)."""
    scale = (e << 23).to(tl.float32, bitcast=True)  # [N, BLOCK_C]
    return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]


@triton.jit
def e2m1_value(nib):
    """e2m1 nibble (int32 0..15) -> fp32 value, built from bits: exact."""
    e = (nib >> 1) & 3
    m = nib & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return (bits | ((nib & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def tile_ids(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row tiles (about one expert) sweep the column tiles together, so
    an expert's weight tile and the x rows are reused from L2."""
    pid = tl.program_id(0)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit
def scales_at(ptrs, mask, SCALE_E8M0: tl.constexpr):
    """fp32 block scales at `ptrs` (any shape): UE8M0 bytes as 2^(b - 127), else fp32 as stored."""
    # one return: Triton 3.6 type-checks every return of a jit function, constexpr-dead or not
    if SCALE_E8M0:
        sb = tl.load(ptrs, mask=mask, other=127).to(tl.int32) & 0xFF
        # byte 0 is 2^-127, an fp32 subnormal (0 << 23 would read as zero)
        scale = tl.where(sb == 0, 5.877471754111438e-39, (sb << 23).to(tl.float32, bitcast=True))
    else:
        scale = tl.load(ptrs, mask=mask, other=1.0)
    return scale


@triton.jit
def block_scale(s_rows, n_ok, k0, stride_sk, SCALE_E8M0: tl.constexpr):
    """The [BLOCK_N] fp32 scales of weight rows `s_rows` (pointers) at K step k0."""
    return scales_at(s_rows + (k0 // 128) * stride_sk, n_ok, SCALE_E8M0)


@triton.jit
def weight_rows(w_ptr, s_ptr, g, N, n, stride_wn, stride_sn):
    """Pointers to the weight rows and scale rows of output features `n` [BLOCK_N] of group g
    (the global weight row g * N + n; its scale row that // 128)."""
    w_row = (g * N + n).to(tl.int64)
    return w_ptr + w_row * stride_wn, s_ptr + (w_row // 128) * stride_sn


@triton.jit
def store_tile(out_ptr, acc, pid_s, rows, row_ok, g, n, n_ok, stride_os, stride_ot, stride_og,
                TRANSPOSED: tl.constexpr):  # fmt: skip
    """Store acc [rows, n] (TRANSPOSED: [n, rows]) at out [split pid_s, row, group g, n]."""
    out_rows = (out_ptr + pid_s.to(tl.int64) * stride_os + rows.to(tl.int64) * stride_ot
                + g * stride_og)  # fmt: skip
    if TRANSPOSED:  # the transposed tile through transposed pointers
        tl.store(out_rows[None, :] + n[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=n_ok[:, None] & row_ok[None, :])  # fmt: skip
    else:
        tl.store(out_rows[:, None] + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])  # fmt: skip


@triton.jit
def last_split_adds(acc, part_ptrs, y_ptrs, mask, pid_s, num_splits, stride_os, count_ptr,
                    ROUND_OUT: tl.constexpr):  # fmt: skip
    """Store acc (any 2-D tile) as split pid_s's partial at part_ptrs + pid_s * stride_os; the
    program of the tile that finishes last stores y = sum over s in order 0..S-1 at y_ptrs."""
    tl.store(part_ptrs + pid_s.to(tl.int64) * stride_os, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial is written before the ticket is taken
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == num_splits - 1:
        total = tl.zeros_like(acc)
        for s in range(num_splits):  # .cg: from L2, where the other programs' partials are
            total += tl.load(part_ptrs + s * stride_os, mask=mask, other=0.0, cache_modifier=".cg")
        if ROUND_OUT:  # the interpreter truncates on the cast; the GPU rounds
            total = bf16_rne(total)
        tl.store(y_ptrs, total.to(y_ptrs.dtype.element_ty), mask=mask)
        tl.atomic_xchg(count_ptr, 0)  # ready for the next launch (graph replays included)


@triton.jit
def store_split(out_ptr, y_ptr, count_ptr, acc, rows, row_ok, g, n, n_ok, stride_os, stride_ot,
                stride_og, TRANSPOSED: tl.constexpr, IN_KERNEL_REDUCE: tl.constexpr,
                ROUND_OUT: tl.constexpr):  # fmt: skip
    """The linears' epilogue. acc [rows, n] (TRANSPOSED: [n, rows]) of program (tile, split,
    group g) = (program_id 0, 1, 2): stored at out [split, row, g, n] (y itself for one split,
    else fp32 partials [S, T, G, N] that a second launch adds), or IN_KERNEL_REDUCE: the
    partial stored and, by the tile's last program, y [T, G, N] (strides of out's [T, G, N])."""
    pid_s = tl.program_id(1)
    if IN_KERNEL_REDUCE:
        at = rows.to(tl.int64) * stride_ot + g * stride_og
        if TRANSPOSED:
            offs, mask = at[None, :] + n[:, None], n_ok[:, None] & row_ok[None, :]
        else:
            offs, mask = at[:, None] + n[None, :], row_ok[:, None] & n_ok[None, :]
        tile = g * tl.num_programs(0) + tl.program_id(0)
        last_split_adds(acc, out_ptr + offs, y_ptr + offs, mask, pid_s, tl.num_programs(1),
                        stride_os, count_ptr + tile, ROUND_OUT)  # fmt: skip
    else:
        if ROUND_OUT:  # the interpreter truncates on the cast; the GPU rounds
            acc = bf16_rne(acc)
        store_tile(out_ptr, acc, pid_s, rows, row_ok, g, n, n_ok, stride_os, stride_ot,
                   stride_og, TRANSPOSED)  # fmt: skip


@triton.jit
def candidate_slots(slot_row_ptr, n, end, win_base, comp_base, NUM_WIN: tl.constexpr):
    """Sparse attention candidates n [BLOCK_N] of one token -> (global slots, valid): -1 = none;
    the first NUM_WIN columns are ring-relative window slots (+ win_base: the layer's ring page
    of the request), the others + comp_base (the layer's compressed page offset)."""
    slot = tl.load(slot_row_ptr + n, mask=n < end, other=-1)
    ok = slot >= 0
    if NUM_WIN > 0:
        slot = tl.where(ok, slot + tl.where(n < NUM_WIN, win_base, comp_base), slot)
    else:
        slot = tl.where(ok, slot + comp_base, slot)
    return slot, ok


@triton.jit
def split_window(pid_t, pid_s, split_len, C, wbase_ptr, comp_base, NUM_WIN: tl.constexpr):
    """(first, end) candidate of split pid_s of token pid_t, and the token's window base."""
    start = pid_s * split_len
    win_base = comp_base
    if NUM_WIN > 0:
        win_base = tl.load(wbase_ptr + pid_t)
    return start, tl.minimum(start + split_len, C), win_base


@triton.jit
def token_request(t2r_ptr, len_ptr, bt_ptr, t, N, STRIDE_BT):
    """(its request's block-table row, visible entries n <= N) of token t; n = 0 for padding
    (token_to_req[t] = -1), whose row pointer is request 0's (read only under n masks)."""
    req = tl.load(t2r_ptr + t)
    n = tl.where(req >= 0, tl.minimum(tl.load(len_ptr + t), N), 0)
    return bt_ptr + tl.maximum(req, 0).to(tl.int64) * STRIDE_BT, n
