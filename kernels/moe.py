"""Routed MoE experts as two grouped GEMMs over expert-sorted rows (docs/model.md#moe).

For every (token t, slot k) pair routed to expert e = expert_ids[t, k] with weight w[t, k]:
    g, a = bf16(W1_e x_t), bf16(W3_e x_t);  g <- min(g, limit);  a <- clamp(a, -limit, limit)
    h = bf16(silu(g) * a);  y_t += w[t, k] * bf16(W2_e h)          (fp32 accumulation)
which is `dsv4.model.moe.swiglu` per expert, with its roundings (`moe_experts_ref` is that loop).

Steps, all without a host sync (CUDA-graph capturable):
1. `moe_align` (kernels/moe_align.py: one launch up to 2048 pairs, torch ops above): the T*K
   pairs sorted by expert, each expert's run padded to a multiple of BLOCK_M (pad = the sentinel
   T*K), and the expert of every BLOCK_M-row tile (-1 for the unused tail tiles of the static
   upper bound floor(T*K / BLOCK_M) + min(T*K, E)).
2. `_w13_kernel`: per (row tile, BLOCK_N columns of I) the gate and up GEMMs share the gathered
   x tile; SwiGLU with the clamp in the epilogue; h [rows, I] bf16 in sorted order.
3. `_w2_kernel`: per (row tile, BLOCK_N columns of D) h @ W2_e^T, stored bf16 to the pair's row
   t*K + k of a [T*K, D] buffer.
4. `_moe_combine_kernel`: y_t = sum_k w[t, k] * row[t*K + k] in fp32, in k order: deterministic (no
   atomics), so a token's output does not depend on the batch.
The routing weight is applied in fp32 after W2 (as the model does) rather than folded into h
before W2, which would round w*h to bf16; the cost is the combine pass (~2% at 8192 tokens).

Weight formats, dequantised in registers right after the load (the MMA runs in bf16, exactly
on the dequantised values, as the reference's dequantise-then-GEMM):
- "bf16": w13 [E, 2I, D] (rows [0, I) = W1 gate, [I, 2I) = W3 up), w2 [E, D, I];
- "fp8": the same shapes in float8_e4m3fn, scales [E, ceil(rows/128), ceil(cols/128)] (UE8M0 or
  fp32) per 128x128 block; BLOCK_K divides 128 so a K step sits in one scale block;
- "mxfp4": int8 [E, rows, cols/2] packed e2m1 pairs (low nibble = even column), UE8M0 scales
  [E, rows, cols/32]. The even and odd columns of the x tile are loaded separately and meet the
  low and high nibbles in two half-K dots, so no nibble interleave is needed.
Decode-sized MXFP4 steps (<= moe_gemv.GEMV_MAX_PAIRS_PER_EXPERT pairs an expert, 128 tokens of
V4-Flash) run as a batched CUDA-core GEMV instead (kernels/moe_gemv.py: 1.6x bf16 experts at
1-16 tokens on the H200, 3.1x this kernel at one token); tune GEMV=False keeps this kernel.
Prefill-sized MXFP4 steps (>= DEQUANT_MIN_PAIRS_PER_EXPERT pairs an expert) instead dequantise
the experts chunk by chunk into a bf16 scratch and run these GEMMs in bf16 (kernels/
moe_dequant.py): on the H200 3x faster at 8192 tokens than the per-element nibble decode.

Shared expert: fused only behind `features.fuse_shared_expert` (bf16 experts, decode-sized
steps: the paged forward routes every token to slot E of the stacked storage). In checkpoints it
is FP8 while the routed experts are MXFP4 (one launch takes one format), at 8192 tokens it is a
dense GEMM at full tile occupancy on its own, and on the H200 the fusion paid 1.06x at batch 1
only while rounding unlike cuBLAS (docs/BENCHMARKS.md), so it is off by default. Call
`moe_experts` with expert_ids = 0 and one expert's weights for it alone (`shared_expert`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.model.moe import swiglu
from dsv4.model.quant import dequantize
from kernels import moe_gemv, moe_mxfp4
from kernels.compressor import _bf16_rne
from kernels.fp8_dequant import scale_operand
from kernels.moe_align import moe_align, moe_align_ref
from kernels.registry import register_op
from kernels.specialize import sizes_vary

FORMATS = ("bf16", "fp8", "mxfp4", *moe_mxfp4.HALVES_FORMATS)
# FMT codes past FORMATS' first three (kernels/moe_mxfp4.py): "mxfp4" through tl.dot_scaled
# (tune DOT_SCALED), and the "halves" layouts
FMT_DOT_SCALED, FMT_HALVES = 3, 4
# SWAP_AB: compute each tile transposed, W_tile @ a^T, so the weight dequantised in registers is
# the MMA's A operand (Hopper's wgmma reads B from shared memory only) and a decode step's few
# rows per expert sit on the MMA's N side. `_config` turns it on for quantised experts at
# decode sizes (BLOCK_M 16), where the H200 sweep (--only moe_tile) measured it faster.
SWAP_AB_DEFAULT = False
# MXFP4 at decode sizes through kernels/moe_gemv.py (moe_gemv.use_gemv); False: the in-register
# MMA kernel below at every size (tune GEMV overrides either way).
GEMV_DEFAULT = True
_MMA_KEYS = {
    "SWAP_AB",
    "BLOCK_K",
    "GROUP_M",
    "num_stages",
    "DOT_SCALED",
}  # a tune of the MMA kernel: no GEMV


@triton.jit
def _e2m1_value(nib):
    """e2m1 nibble (int32 0..15) -> fp32 value, built from bits: exact."""
    e = (nib >> 1) & 3
    m = nib & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return (bits | ((nib & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _load_a(a_rows, k0, row_ok, K, FMT: tl.constexpr, BLOCK_K: tl.constexpr,
            UPCAST: tl.constexpr):  # fmt: skip
    """The [BLOCK_M, BLOCK_K] activation tile at columns k0.. of rows `a_rows` (pointers);
    for MXFP4 its even and odd columns as two [BLOCK_M, BLOCK_K/2] tiles."""
    kk = k0 + tl.arange(0, BLOCK_K // 2 if FMT == 4 else BLOCK_K)
    a = tl.load(a_rows[:, None] + kk[None, :], mask=row_ok[:, None] & (kk < K)[None, :], other=0.0)
    if UPCAST and FMT != 3:  # the interpreter computes on raw bf16 bits otherwise
        a = a.to(tl.float32)
    if FMT == 4:  # "halves": x columns k0.. and k0 + BLOCK_K/2.., each its own load
        a1 = tl.load(a_rows[:, None] + (kk + BLOCK_K // 2)[None, :], mask=row_ok[:, None],
                     other=0.0)  # fmt: skip
        a0, a1 = a, a1.to(a.dtype)
    elif FMT == 2:  # one contiguous load, split into even/odd columns in registers
        a0, a1 = tl.split(tl.reshape(a, [a.shape[0], BLOCK_K // 2, 2]))
    else:
        a0, a1 = a, a
    return a0, a1


@triton.jit
def _mma(acc, a, w, SWAP_AB: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] += a @ w, or with SWAP_AB acc [BLOCK_N, BLOCK_M] += w @ a^T: w
    [BLOCK_N, k] is then the MMA's A operand, which Hopper's wgmma may take from registers (B
    only from shared memory), and the weight rows fill the MMA's M side."""
    if SWAP_AB:
        acc = tl.dot(w, tl.trans(a), acc)
    else:
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _dot_w(acc, a0, a1, w_ptr, s_ptr, n, n_ok, k0, K, stride_wn, stride_sn, stride_sk,
           FMT: tl.constexpr, SCALE_E8M0: tl.constexpr, BLOCK_K: tl.constexpr,
           BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, SWAP_AB: tl.constexpr):  # fmt: skip
    """acc += a @ W[n, k0:k0+BLOCK_K]^T with W dequantised in registers (one expert's w_ptr);
    SWAP_AB: acc^T [BLOCK_N, BLOCK_M] += W[n, k0:k0+BLOCK_K] @ a^T (W tiles [BLOCK_N, BLOCK_K])."""
    kh = tl.arange(0, BLOCK_K // 2)
    ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    kk = k0 + tl.arange(0, BLOCK_K)
    if SWAP_AB:  # weight tiles [BLOCK_N, BLOCK_K(/2)]: W's own layout
        wn, wn_ok = n.to(tl.int64)[:, None], n_ok[:, None]
        kh, ks, kk = kh[None, :], ks[None, :], kk[None, :]
    else:  # weight tiles [BLOCK_K(/2), BLOCK_N]
        wn, wn_ok = n.to(tl.int64)[None, :], n_ok[None, :]
        kh, ks, kk = kh[:, None], ks[:, None], kk[:, None]
    w_rows = w_ptr + wn * stride_wn
    if FMT >= 3:  # kernels/moe_mxfp4.py's candidates
        acc = moe_mxfp4.dot_mx(acc, a0, a1, w_rows, s_ptr + wn * stride_sn, wn_ok, k0, K,
                               stride_sk, FMT, BLOCK_K, BLOCK_N, SWAP_AB)  # fmt: skip
    elif FMT == 2:  # MXFP4: packed bytes, scales per 32 columns
        # NOTE: masked per 32-column scale group (K and k0 are multiples of 32), not per byte:
        # compiled for sm_90, a per-byte mask (2*kh strides by 2) split them into 1-byte loads
        # that were not pipelined
        mk = (k0 + 32 * (kh // 16) < K) & wn_ok
        packed = tl.load(w_rows + (k0 // 2 + kh), mask=mk, other=0).to(tl.int32) & 0xFF
        sb = tl.load(s_ptr + wn * stride_sn + ks * stride_sk, mask=(ks * 32 < K) & wn_ok,
                     other=127).to(tl.int32) & 0xFF  # fmt: skip
        scale = (sb << 23).to(tl.float32, bitcast=True)  # 2^(byte - 127), each over 16 bytes
        if SWAP_AB:
            scale = tl.reshape(tl.broadcast_to(scale[:, :, None], [BLOCK_N, BLOCK_K // 32, 16]),
                               [BLOCK_N, BLOCK_K // 2])  # fmt: skip
        else:
            scale = tl.reshape(tl.broadcast_to(scale[:, None, :], [BLOCK_K // 32, 16, BLOCK_N]),
                               [BLOCK_K // 2, BLOCK_N])  # fmt: skip
        lo = (_e2m1_value(packed & 15) * scale).to(a0.dtype)
        hi = (_e2m1_value(packed >> 4) * scale).to(a0.dtype)
        acc = _mma(acc, a0, lo, SWAP_AB)
        acc = _mma(acc, a1, hi, SWAP_AB)
    else:
        b = tl.load(w_rows + kk, mask=(kk < K) & wn_ok, other=0.0)
        if FMT == 1:  # FP8 e4m3 with one scale per 128x128 block
            s_off = (wn // 128) * stride_sn + (k0 // 128) * stride_sk
            if SCALE_E8M0:
                sb = tl.load(s_ptr + s_off, mask=wn_ok, other=127).to(tl.int32) & 0xFF
                scale = (sb << 23).to(tl.float32, bitcast=True)
            else:
                scale = tl.load(s_ptr + s_off, mask=wn_ok, other=1.0)
            b = (b.to(tl.float32) * scale).to(a0.dtype)
        elif UPCAST:
            b = b.to(tl.float32)
        acc = _mma(acc, a0, b, SWAP_AB)
    return acc


@triton.jit
def _tile_ids(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row tiles (about one expert) sweep the column tiles together, so
    an expert's weight tile and the x rows are reused from L2."""
    pid = tl.program_id(0)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit(**sizes_vary("num_pairs", "num_pid_m"))
def _w13_kernel(
    # Pointers: x [T, D] bf16; sorted pair ids [P] int32; tile expert [P / BLOCK_M] int32;
    # w13 [E, 2I, D(/2)] and its scales; output h [P, I] bf16
    x_ptr, ids_ptr, tile_e_ptr, w_ptr, s_ptr, h_ptr,
    # Sizes, strides (elements), scalars
    num_pairs, D, INTER, num_pid_m,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_h, limit,
    # Meta-parameters
    TOPK: tl.constexpr, FMT: tl.constexpr, SCALE_E8M0: tl.constexpr, HAS_LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, SWAP_AB: tl.constexpr = False,
):  # fmt: skip
    pid_m, pid_n = _tile_ids(num_pid_m, tl.cdiv(INTER, BLOCK_N), GROUP_M)
    e = tl.load(tile_e_ptr + pid_m)
    if e >= 0:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(ids_ptr + rows)
        row_ok = pair < num_pairs
        a_rows = x_ptr + (pair // TOPK).to(tl.int64) * stride_x
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < INTER
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        acc_g = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros_like(acc_g)
        for k0 in range(0, D, BLOCK_K):
            a0, a1 = _load_a(a_rows, k0, row_ok, D, FMT, BLOCK_K, UPCAST)
            acc_g = _dot_w(acc_g, a0, a1, w_e, s_e, n, n_ok, k0, D, stride_wn, stride_sn,
                           stride_sk, FMT, SCALE_E8M0, BLOCK_K, BLOCK_N, UPCAST,
                           SWAP_AB)  # fmt: skip
            acc_u = _dot_w(acc_u, a0, a1, w_e, s_e, n + INTER, n_ok, k0, D, stride_wn, stride_sn,
                           stride_sk, FMT, SCALE_E8M0, BLOCK_K, BLOCK_N, UPCAST,
                           SWAP_AB)  # fmt: skip
        g = _bf16_rne(acc_g)  # the reference's F.linear outputs are bf16
        u = _bf16_rne(acc_u)
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        h = _bf16_rne(g / (1.0 + tl.exp(-g)) * u)
        if SWAP_AB:  # elementwise so far: one transpose, of h
            h = tl.trans(h)
        h_at = h_ptr + rows.to(tl.int64)[:, None] * stride_h + n[None, :]
        tl.store(h_at, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(**sizes_vary("num_pairs", "num_pid_m"))
def _w2_kernel(
    # Pointers: h [P, I] bf16; sorted pair ids; tile expert; w2 [E, D, I(/2)] and scales;
    # output rows [T*K, D] bf16 (one per (token, slot) pair)
    h_ptr, ids_ptr, tile_e_ptr, w_ptr, s_ptr, out_ptr,
    # Sizes, strides (elements)
    num_pairs, D, INTER, num_pid_m,
    stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_out,
    # Meta-parameters
    FMT: tl.constexpr, SCALE_E8M0: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, SWAP_AB: tl.constexpr = False,
):  # fmt: skip
    pid_m, pid_n = _tile_ids(num_pid_m, tl.cdiv(D, BLOCK_N), GROUP_M)
    e = tl.load(tile_e_ptr + pid_m)
    if e >= 0:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(ids_ptr + rows)
        row_ok = pair < num_pairs
        a_rows = h_ptr + rows.to(tl.int64) * stride_h
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < D
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            a0, a1 = _load_a(a_rows, k0, row_ok, INTER, FMT, BLOCK_K, UPCAST)
            acc = _dot_w(acc, a0, a1, w_e, s_e, n, n_ok, k0, INTER, stride_wn, stride_sn, stride_sk,
                         FMT, SCALE_E8M0, BLOCK_K, BLOCK_N, UPCAST, SWAP_AB)  # fmt: skip
        out = _bf16_rne(acc)
        if SWAP_AB:
            out = tl.trans(out)
        out_at = out_ptr + pair.to(tl.int64)[:, None] * stride_out + n[None, :]
        tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(**sizes_vary("T"))
def _moe_combine_kernel(rows_ptr, w_ptr, y_ptr, T, D, TOPK: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_D: tl.constexpr):  # fmt: skip
    """y[t] = sum_k w[t, k] * rows[t*K + k] in fp32, k ascending."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mk = (t < T)[:, None] & (d < D)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for k in tl.static_range(TOPK):
        pair = t.to(tl.int64) * TOPK + k
        w = tl.load(w_ptr + pair, mask=t < T, other=0.0)
        r = tl.load(rows_ptr + pair[:, None] * D + d[None, :], mask=mk, other=0.0)
        acc += w[:, None] * r.to(tl.float32)
    tl.store(y_ptr + t.to(tl.int64)[:, None] * D + d[None, :], acc, mask=mk)


def _config(num_pairs: int, num_experts: int, on_gpu: bool, format: str = "bf16") -> dict:
    if not on_gpu:  # interpreter: few, large programs
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1)
    per_expert = num_pairs / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    cfg = dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=64, GROUP_M=4 if block_m == 64 else 8,
               num_warps=8 if block_m == 64 else 4, num_stages=3)  # fmt: skip
    if format != "bf16" and block_m == 16:  # decode: H200, 1-64 tokens, 1.05-1.35x (moe_tile)
        cfg.update(SWAP_AB=True, BLOCK_N=64)
    return cfg


def _scale_args(scale: torch.Tensor | None, like: torch.Tensor):
    if scale is None:  # bf16: a dummy pointer, never read
        return like, True, (0, 0, 0)
    s, e8m0 = scale_operand(scale)
    return s, e8m0, (s.stride(0), s.stride(1), s.stride(2))


def moe_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    format: str = "bf16",
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    limit: float | None = None,
    *,
    tune: dict | None = None,
) -> torch.Tensor:
    """Routed experts: x [T, D] bf16, expert_ids [T, K] int, weights [T, K] fp32, w13/w2 (and
    scales) in `format` (see the module doc) -> y [T, D] fp32 = sum_k w * expert(x). `tune`:
    config overrides (BLOCK_M/N/K, GROUP_M, num_warps, num_stages, SWAP_AB, DEQUANT,
    CHUNK_EXPERTS, DOT_SCALED; GEMV and moe_gemv.gemv_config's keys)."""
    assert format in FORMATS, format
    assert x.dim() == 2 and x.dtype == torch.bfloat16 and x.stride(1) == 1
    num_tokens, dim = x.shape
    topk = expert_ids.shape[1]
    num_experts, two_inter = w13.shape[0], w13.shape[1]
    inter = two_inter // 2
    assert w2.shape[:2] == (num_experts, dim) and w13.stride(2) == w2.stride(2) == 1
    assert format == "bf16" or (w13_scale is not None and w2_scale is not None)
    y = torch.zeros(num_tokens, dim, dtype=torch.float32, device=x.device)
    num_pairs = num_tokens * topk
    if num_pairs == 0:
        return y
    tune = dict(tune or {})
    # candidates (kernels/moe_mxfp4.py): "mxfp4" through tl.dot_scaled; the "halves" layouts
    dot_scaled, halves = tune.pop("DOT_SCALED", False), moe_mxfp4.halves_block(format)
    assert not dot_scaled or format == "mxfp4", format
    fmt = FMT_DOT_SCALED if dot_scaled else FMT_HALVES if halves else FORMATS.index(format)
    # prefill-sized MXFP4: the experts through a bf16 scratch, chunk by chunk (kernels/moe_dequant)
    dequant = tune.pop(
        "DEQUANT", fmt == 2 and _use_dequant(num_pairs, num_experts, format, x.is_cuda)
    )
    chunk_experts = tune.pop("CHUNK_EXPERTS", None)  # the scratch's experts (default: 1 GiB)
    # decode-sized MXFP4: a batched GEMV on the CUDA cores (kernels/moe_gemv.py)
    gemv = tune.pop("GEMV", GEMV_DEFAULT and not dequant and not tune.keys() & _MMA_KEYS
                    and moe_gemv.use_gemv(num_pairs, num_experts, format))  # fmt: skip
    if gemv:
        assert format == "mxfp4" and not dequant, format
        cfg = {**moe_gemv.gemv_config(num_pairs, num_experts, x.is_cuda), **tune}
        return _via_gemv(x, expert_ids, weights, w13, w2, (w13_scale, w2_scale), limit, cfg, y)
    if fmt >= FMT_DOT_SCALED:
        cfg = moe_mxfp4.mx_config(num_pairs, num_experts, x.is_cuda, halves)
    else:
        cfg = _config(num_pairs, num_experts, x.is_cuda, "bf16" if dequant else format)
    cfg.update(tune)
    swap_ab = bool(cfg.pop("SWAP_AB", SWAP_AB_DEFAULT))
    if not dequant:
        bk = cfg["BLOCK_K"]
        assert format != "fp8" or 128 % bk == 0, "an FP8 K step must sit in one scale block"
        # MXFP4 K steps and masks work in whole scale groups of 32 columns
        assert fmt not in (2, 3) or bk % 32 == dim % 32 == inter % 32 == 0, (bk, dim, inter)
        assert not halves or (bk == halves and dim % bk == inter % bk == 0), (bk, dim, inter)
    # NOTE: the one-launch align on CUDA; under the CPU interpreter its in-register sort costs
    # ~0.2 s a call (its own tests cover it), so the engine's interpreted runs use the torch ops
    align = moe_align if x.is_cuda else moe_align_ref
    sorted_ids, tile_e = align(expert_ids, num_experts, cfg["BLOCK_M"])
    h = torch.empty(sorted_ids.numel(), inter, dtype=torch.bfloat16, device=x.device)
    rows = torch.empty(num_pairs, dim, dtype=torch.bfloat16, device=x.device)
    gemms = (x, sorted_ids, tile_e, w13, w2, (w13_scale, w2_scale), h, rows, topk, limit)
    if dequant:
        _gemms_through_scratch(*gemms, format, cfg, chunk_experts)
    else:
        grouped_gemms(*gemms, fmt, cfg, swap_ab)
    return _combine(rows, weights, y, topk)


def _via_gemv(x, expert_ids, weights, w13, w2, scales, limit, cfg: dict, y) -> torch.Tensor:
    align = moe_align if x.is_cuda else moe_align_ref
    sorted_ids, tile_e = align(expert_ids, w13.shape[0], cfg["BLOCK_M"])
    rows = torch.empty(expert_ids.numel(), x.shape[1], dtype=torch.bfloat16, device=x.device)
    moe_gemv.gemv_gemms(x, sorted_ids, tile_e, w13, w2, scales, rows, expert_ids.shape[1], limit,
                        cfg)  # fmt: skip
    return _combine(rows, weights, y, expert_ids.shape[1])


def _combine(rows: torch.Tensor, weights: torch.Tensor, y: torch.Tensor, topk: int):
    """y [T, D] fp32 = sum_k weights[t, k] * rows[t*K + k] (`_moe_combine_kernel`)."""
    num_tokens, dim = y.shape
    block_t, block_d = (4, 1024) if y.is_cuda else (triton.next_power_of_2(num_tokens), 4096)
    block_d = min(block_d, triton.next_power_of_2(dim))
    _moe_combine_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(dim, block_d))](
        rows, weights.float().contiguous(), y, num_tokens, dim,
        TOPK=topk, BLOCK_T=block_t, BLOCK_D=block_d,
    )  # fmt: skip
    return y


def grouped_gemms(x, sorted_ids, tile_e, w13, w2, scales, h, rows, topk, limit, fmt: int,
                  cfg: dict, swap_ab: bool = False) -> None:  # fmt: skip
    """The two GEMMs over the expert-sorted pairs: h [P, I] = SwiGLU(W13_e x), rows [T*K, D] =
    W2_e h, with weights in FORMATS[fmt] and `scales` (w13's, w2's; None for bf16). Row tiles
    whose tile_e is -1 exit at once."""
    num_pairs, dim = rows.shape
    inter, num_pid_m = h.shape[1], tile_e.numel()
    s13, e8m0, st13 = _scale_args(scales[0], w13)
    s2, _, st2 = _scale_args(scales[1], w2)
    common = dict(FMT=fmt, SCALE_E8M0=e8m0, UPCAST=not x.is_cuda, SWAP_AB=swap_ab, **cfg)
    grid13 = (num_pid_m * triton.cdiv(inter, cfg["BLOCK_N"]),)
    _w13_kernel[grid13](
        x, sorted_ids, tile_e, w13, s13, h,
        num_pairs, dim, inter, num_pid_m,
        x.stride(0), w13.stride(0), w13.stride(1), *st13, h.stride(0),
        float(limit) if limit is not None else 0.0,
        TOPK=topk, HAS_LIMIT=limit is not None, **common,
    )  # fmt: skip
    grid2 = (num_pid_m * triton.cdiv(dim, cfg["BLOCK_N"]),)
    _w2_kernel[grid2](
        h, sorted_ids, tile_e, w2, s2, rows,
        num_pairs, dim, inter, num_pid_m,
        h.stride(0), w2.stride(0), w2.stride(1), *st2, rows.stride(0), **common,
    )  # fmt: skip


def _use_dequant(*args) -> bool:
    from kernels.moe_dequant import use_dequant  # it imports this module's kernels

    return use_dequant(*args)


def _gemms_through_scratch(*args) -> None:
    from kernels.moe_dequant import gemms_through_scratch  # it imports this module's kernels

    gemms_through_scratch(*args)


def dequantize_expert(w: torch.Tensor, scale: torch.Tensor | None, format: str,
                      dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:  # fmt: skip
    """One expert's weight [rows, cols(/2)] in `format` -> [rows, cols] in `dtype` (bf16: as
    stored; a "halves" layout: unpacked first)."""
    if moe_mxfp4.halves_block(format):
        w, format = moe_mxfp4.unpack_halves(w, moe_mxfp4.halves_block(format)), "mxfp4"
    return w if format == "bf16" else dequantize(w, scale, format, dtype)


def moe_experts_ref(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    format: str = "bf16",
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    limit: float | None = None,
) -> torch.Tensor:
    """Reference (and the slow path): the model's loop over experts of `swiglu`, with each
    expert's weights dequantised first, to x's dtype (an fp32 model on CPU stays fp32)."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    ids = expert_ids.long()
    for e in ids.unique().tolist():
        token_idx, slot = torch.where(ids == e)
        s13, s2 = (None if s is None else s[e] for s in (w13_scale, w2_scale))
        w13_e = dequantize_expert(w13[e], s13, format, x.dtype)
        w2_e = dequantize_expert(w2[e], s2, format, x.dtype)
        y = swiglu(x[token_idx], w13_e[:inter], w2_e, w13_e[inter:], limit)
        out.index_add_(0, token_idx, y.float() * weights[token_idx, slot].unsqueeze(-1))
    return out


def shared_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, format: str = "bf16",
                  w13_scale=None, w2_scale=None, limit=None) -> torch.Tensor:  # fmt: skip
    """The shared expert through the same kernels: every token to "expert 0" with weight 1.
    w13 [2I, D(/2)], w2 [D, I(/2)] (and scales) of the one expert."""
    ids = torch.zeros(x.shape[0], 1, dtype=torch.int32, device=x.device)
    ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
    unsq = lambda s: None if s is None else s.unsqueeze(0)  # noqa: E731
    return moe_experts(x, ids, ones, w13.unsqueeze(0), w2.unsqueeze(0), format, unsq(w13_scale),
                       unsq(w2_scale), limit)  # fmt: skip


register_op("moe_experts", moe_experts, moe_experts_ref, family="moe")
