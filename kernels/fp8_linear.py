"""FP8 block-scaled linears, weight-only (docs/model.md#fp8-linears): y = x @ W^T, W = e4m3 x scale.

W [N, K] float8_e4m3fn carries one scale per 128x128 block, `scale` [ceil(N/128), ceil(K/128)]
(UE8M0 float8_e8m0fnu in V4 checkpoints, fp32 in -Base ones). Each weight tile is dequantised
in registers right after its load: an fp32 multiply by its block's scale, one cast to x's dtype
(exact for e4m3 x 2^k in bf16), then the MMA with fp32 accumulation. That is the math of
`fp8_linear_ref` (dequantise the weight, then F.linear) up to summation order. BLOCK_K divides
128, so every K step reads one scale column.

Three paths, by row count (`exact_path`, measured; each reachable through `tune` for the sweeps
and tests):
- the GEMV (`kernels/fp8_gemv.py`, CUDA-core FMAs with no MMA) at 1 row, and at 2 for narrow
  linears, as the row-tile config (few weight rows a program, K whole where the grid fills);
- the tiled `tl.dot` kernel below at 2-64 rows (narrow linears: to 16): a weight-streaming
  tile, the dequantised weight on the MMA's left (SWAP_AB), the block scale on the dot's sums
  (POST_SCALE, exact for UE8M0 scales), K split across S programs whose fp32 partials the last
  program of a tile adds in split order (kernels/fp8_splitk.py: deterministic, no atomics;
  without REDUCE "kernel", `_fp8_linear_reduce_kernel` does it in a second launch); a
  grouped-order tiled GEMM at prefill sizes (reached through `tune`);
- above: the weight dequantised once (`kernels/fp8_dequant.py`), then cuBLAS: the reference's
  own computation, so its output is equal, not just close.
`activations="fp8"` (W8A8, its own switch: x rounded to e4m3 per 1x128 group, so not exact)
sends GEMV_MAX_ROWS < T <= W8A8_MAX_ROWS to kernels/fp8_w8a8.py (FP8 x FP8 wgmma), and from
CUBLAS_W8A8_MIN_ROWS rows (grouped: CUBLAS_W8A8_GROUPED_MIN_ROWS) to torch's block-scaled FP8
GEMM (kernels/fp8_linear_cublas.py, cuBLASLt on sm_90: "w8a8_cublas", checked first) where it
runs; the other row counts keep the exact paths, which measured faster there (`w8a8_path`).
`fp8_grouped_linear` is the same with a group axis: attn.wo_a's grouped output projection,
z[:, g] = o[:, g] @ W[g*N:(g+1)*N]^T, in one launch (scale rows follow the global weight row,
so a group need not start on a 128-row block).

Measured (docs/BENCHMARKS.md): on the H200 before issue 21, the tiled kernel with its first
tiles ran at 0.33-0.63x of cuBLAS on the bf16 weight at 1-16 rows; issue 21's candidates on an
H100 (constants below) made every row count from 1 to 16 at least as fast as bf16 but shared_w2
and wkv / wq_a at 4-16 rows (0.91-0.99x), and 1 row 1.52-2.09x. No host sync and no
data-dependent allocation: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dsv4.ops import fp8 as ref_fp8
from dsv4.ops.limits import FP8_GEMV_MAX_ROWS
from kernels import fp8_linear_cublas as cublas
from kernels.fp8_dequant import fp8_dequantize, scale_operand
from kernels.fp8_gemv import (
    gemv_config,
    gemv_rowtile_config,
    launch_gemv,
    num_sms,
    reduce_splits,
    split_k,
    split_output,
)
from kernels.fp8_splitk import in_kernel_reduce, tile_counters
from kernels.fp8_w8a8 import launch_w8a8, w8a8_config
from kernels.jit_helpers import bf16_rne, block_scale, store_split, tile_ids, weight_rows
from kernels.registry import register_op
from kernels.specialize import sizes_vary

FP8_BLOCK = ref_fp8.FP8_BLOCK
# POST_SCALE: cast the e4m3 tile straight to bf16 and multiply the dot's [BLOCK_M, BLOCK_N] sums
# by the block scale, instead of scaling every [BLOCK_K, BLOCK_N] weight element in fp32 before
# the cast (BLOCK_K / BLOCK_M times fewer ALU ops in front of the MMA at decode sizes; the same
# products, the sum split at K-step boundaries). Off until timed on a GPU (`tune`).
POST_SCALE_DEFAULT = False
# SWAP_AB: accT = W_tile @ x_tile^T. Hopper's wgmma reads its B operand only from shared memory
# and may take A from registers, so the weight tile dequantised in registers belongs on the left
# (as Marlin/Machete-style mixed-input kernels place it); decode's few token rows become the
# MMA's N side. Off until timed on a GPU (`tune`).
SWAP_AB_DEFAULT = False
# The exact paths by row count (bf16 activations), from issue 21's A/B of the candidates on an
# H100 (benchmarks/results/fp8-linear-candidates-h100.json: the eight V4-Flash linears, weights
# rotated past L2, one CUDA graph a path; speedup = cuBLAS on the bf16 weight / the FP8 path):
# - 1 row: the row-tile GEMV (`gemv_rowtile_config`, ROWTILE_STEP_BYTES a step), 1.52-2.09x
#   (the previous GEMV 1.16-1.46x);
# - 2 rows: the row-tile GEMV for narrow linears (N x G <= NARROW_N: wkv 1.67x, wq_a 1.26x), the
#   tiled kernel with the weight tile on the MMA's left, the block scale on the dot's sums and
#   the split-K partials added in its own launch (TILED_DECODE) for the others (0.96-1.42x,
#   where the GEMV and dequantise + cuBLAS ran at 0.71-0.93x);
# - 3-16 rows: that tiled kernel, 0.91-1.45x (dequantise + cuBLAS: 0.38-0.75x);
# - 17-64 rows: the tiled kernel for wide linears (0.69-1.13x at 64, dequantise: 0.40-0.66x),
#   dequantise + cuBLAS for narrow ones (wkv 0.76x, wq_a 0.71x; tiled 0.60x, 0.53x);
# - above: dequantise + cuBLAS (0.59-0.96x at 1024-8192): the reference's own computation.
# Each is reachable through `tune` ("GEMV", "STEP_BYTES", "DEQUANT", the tiled keys).
ROWTILE_STEP_BYTES = 8192
NARROW_N = 1024
NARROW_TILED_MAX_ROWS = 16
TILED_MAX_ROWS = 64
TILED_DECODE = {"SWAP_AB": True, "POST_SCALE": True, "REDUCE": "kernel"}
# Up to this many rows the GEMV may run (the planner counts a bf16 copy of the largest FP8 linear
# above it: dsv4.ops.limits).
GEMV_MAX_ROWS = FP8_GEMV_MAX_ROWS  # 2
# With `activations="fp8"` (W8A8, its own switch: x rounded to e4m3 per 1x128 group) the rows
# above GEMV_MAX_ROWS up to this many run kernels/fp8_w8a8.py; above it, dequantise + cuBLAS,
# which ran ahead of the W8A8 GEMM at 1024 and 8192 rows on the H200 (and is exact).
W8A8_MAX_ROWS = 64
# With `activations="fp8"`, from this many rows (and N, K multiples of 128 on sm_90) torch's
# block-scaled FP8 GEMM (cuBLASLt; kernels/fp8_linear_cublas.py) instead of dequantise + cuBLAS.
# H100, 2026-12-07 (bench_fp8_linear_vs_bf16.py, path "w8a8_cublas"): it costs ~15 us whatever
# the rows (so not at 64, the Triton W8A8's), equals the Triton W8A8 GEMM at 1024 and 8192 rows
# and beats dequantise + cuBLAS there by 1.2-1.9x, except for N = 512 (wkv: 0.82x / 0.77x, hence
# CUBLAS_W8A8_MIN_N). Grouped linears (wo_a) run one GEMM a group: 0.89x the exact path at 1024
# rows, 1.07x at 8192, hence their own bound.
CUBLAS_W8A8_MIN_ROWS = 65
CUBLAS_W8A8_MIN_N = 1024
CUBLAS_W8A8_GROUPED_MIN_ROWS = 4096


def exact_path(rows: int, n: int, groups: int) -> str:
    """The measured fastest exact path for `rows` rows of a linear with N x G output columns:
    "rowtile" (the GEMV), "tiled" (`_fp8_linear_kernel` with TILED_DECODE) or "dequant"."""
    narrow = n * groups <= NARROW_N
    if rows == 1 or (rows <= GEMV_MAX_ROWS and narrow):
        return "rowtile"
    if rows <= (NARROW_TILED_MAX_ROWS if narrow else TILED_MAX_ROWS):
        return "tiled"
    return "dequant"


def w8a8_path(rows: int, n: int, groups: int, cublas_ok: bool) -> str:
    """The W8A8 switch's path for `rows` rows (N x G output columns): "w8a8_cublas" (torch's
    block-scaled GEMM; `cublas_ok`: `fp8_linear_cublas.supported`), "w8a8" (kernels/fp8_w8a8.py)
    or, outside both, the exact path's name."""
    floor = CUBLAS_W8A8_MIN_ROWS if groups == 1 else CUBLAS_W8A8_GROUPED_MIN_ROWS
    if cublas_ok and rows >= floor and n * groups >= CUBLAS_W8A8_MIN_N:
        return "w8a8_cublas"
    if GEMV_MAX_ROWS < rows <= W8A8_MAX_ROWS:
        return "w8a8"
    return exact_path(rows, n, groups)


@triton.jit(**sizes_vary("T", "split_len"))
def _fp8_linear_kernel(
    # Pointers: x [T, G, K] (K contiguous), w [G*N, K] e4m3, scales [ceil(G*N/128), ceil(K/128)];
    # out: y [T, G, N] in x's dtype (one split) or fp32 partials [S, T, G, N]; y_ptr, count_ptr:
    # y and the tile counters for IN_KERNEL_REDUCE (kernels/fp8_splitk.py)
    x_ptr, w_ptr, s_ptr, out_ptr, y_ptr, count_ptr,
    # Sizes (T rows per step; N, K fixed by the layer), strides (elements)
    T, N, K, split_len,
    stride_xt, stride_xg, stride_wn, stride_sn, stride_sk, stride_os, stride_ot, stride_og,
    # Meta-parameters
    SCALE_E8M0: tl.constexpr, ROUND_W: tl.constexpr, ROUND_OUT: tl.constexpr, UPCAST: tl.constexpr,
    POST_SCALE: tl.constexpr, SWAP_AB: tl.constexpr, IN_KERNEL_REDUCE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tile_ids(tl.cdiv(T, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    pid_s, g = tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    x_rows = x_ptr + rows.to(tl.int64) * stride_xt + g * stride_xg
    w_rows, s_rows = weight_rows(w_ptr, s_ptr, g, N, n, stride_wn, stride_sn)
    # SWAP_AB: accT [BLOCK_N, BLOCK_M] = W_tile @ x_tile^T, the dequantised weight as the LHS
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], tl.float32)
    # split_len is a multiple of the K step: written so, k0 is known to be one (vector loads)
    k_lo = pid_s * split_len // BLOCK_K * BLOCK_K
    for k0 in range(k_lo, tl.minimum(K, k_lo + split_len), BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        if SWAP_AB:  # x^T [BLOCK_K, BLOCK_M], W [BLOCK_N, BLOCK_K] as stored (K contiguous)
            a = tl.load(x_rows[None, :] + kk[:, None], mask=k_ok[:, None] & row_ok[None, :],
                        other=0.0)  # fmt: skip
            b = tl.load(w_rows[:, None] + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)  # fmt: skip
        else:  # x [BLOCK_M, BLOCK_K], W^T [BLOCK_K, BLOCK_N]
            a = tl.load(x_rows[:, None] + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)  # fmt: skip
            b = tl.load(w_rows[None, :] + kk[:, None], mask=k_ok[:, None] & n_ok[None, :],
                        other=0.0)  # fmt: skip
        scale = block_scale(s_rows, n_ok, k0, stride_sk, SCALE_E8M0)  # [BLOCK_N]
        scale = scale[:, None] if SWAP_AB else scale[None, :]
        if UPCAST:  # the interpreter computes on raw bf16 bits otherwise
            a = a.to(tl.float32)
        if POST_SCALE:  # e4m3 -> x's dtype (exact), the power-of-two scale on the step's sums
            w = b.to(tl.float32) if UPCAST else b.to(x_ptr.dtype.element_ty)
            if SWAP_AB:
                acc += tl.dot(w, a, input_precision=DOT_PRECISION) * scale
            else:
                acc += tl.dot(a, w, input_precision=DOT_PRECISION) * scale
        else:
            w = b.to(tl.float32) * scale
            if UPCAST and ROUND_W:  # the reference's dequantised bf16 weight (rounds fp32 scales)
                w = bf16_rne(w)
            elif not UPCAST:
                w = w.to(x_ptr.dtype.element_ty)
            if SWAP_AB:
                acc = tl.dot(w, a, acc, input_precision=DOT_PRECISION)
            else:
                acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    store_split(out_ptr, y_ptr, count_ptr, acc, rows, row_ok, g, n, n_ok, stride_os, stride_ot,
                stride_og, SWAP_AB, IN_KERNEL_REDUCE, ROUND_OUT)  # fmt: skip


def _config(rows: int, n: int, k: int, groups: int, device: torch.device) -> dict:
    """Tiles and the K split for a [rows, K] x [N, K]^T product per group."""
    if device.type != "cuda":  # interpreter: few, large programs
        return dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=1,
                    splits=1)  # fmt: skip
    if rows <= 64:  # decode: stream the weight, one row tile, fill the SMs by splitting K
        cfg = dict(BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=64, BLOCK_K=128,
                   GROUP_M=1, num_warps=4, num_stages=4)  # fmt: skip
    elif rows <= 256:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    tiles = triton.cdiv(rows, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]) * groups
    steps = triton.cdiv(k, cfg["BLOCK_K"])
    sms = num_sms(device.index if device.index is not None else torch.cuda.current_device())
    # >= 2 K steps per split; partials (S x rows x N fp32) at most ~4x the weight's bytes
    splits = min(triton.cdiv(2 * sms, tiles), max(1, steps // 2), max(1, k // rows))
    return {**cfg, "splits": max(1, splits)}


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, tune: dict | None,
            activations: str = "bf16"):  # fmt: skip
    """x [T, G, K] (K contiguous) -> y [T, G, N] in x's dtype."""
    rows, groups, k = x.shape
    n = weight.shape[0] // groups
    assert x.dtype in (torch.bfloat16, torch.float32) and x.stride(2) == 1, (x.dtype, x.stride())
    assert weight.dtype == torch.float8_e4m3fn and weight.shape == (groups * n, k)
    assert weight.stride(1) == 1
    assert scale.shape == (triton.cdiv(groups * n, FP8_BLOCK), triton.cdiv(k, FP8_BLOCK))
    tune = dict(tune or {})
    fp8 = activations == "fp8"
    acts = w8a8_path(rows, n, groups, fp8 and cublas.supported(x, n, k)) if fp8 else "bf16"
    if tune.pop("CUBLAS", acts == "w8a8_cublas"):  # x per 1x128 group, cuBLASLt block scales
        return cublas.w8a8_cublas(x, weight, scale)  # (allocates its own, row-padded output)
    y = torch.empty(rows, groups, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    path = exact_path(rows, n, groups)
    if tune.pop("GEMV", path == "rowtile"):  # decode rows: CUDA-core FMAs, no MMA
        # an explicit GEMV without STEP_BYTES: the first GEMV's config (the sweeps' baseline)
        default_step = ROWTILE_STEP_BYTES if path == "rowtile" and "STEP_BYTES" not in tune else 0
        step_bytes = tune.pop("STEP_BYTES", default_step)
        cfg = (gemv_rowtile_config(rows, n, k, groups, x.device, step_bytes) if step_bytes
               else gemv_config(rows, n, k, groups, x.device))  # fmt: skip
        launch_gemv(x, weight, scale, y, {**cfg, **tune})
        return y
    if tune.pop("W8A8", acts == "w8a8"):  # x quantised per 1x128 group, FP8 x FP8 MMA
        launch_w8a8(x, weight, scale, y, {**w8a8_config(rows, n, k, groups, x.device), **tune})
        return y
    if tune.pop("DEQUANT", path == "dequant"):  # dequantise once, then cuBLAS
        w = fp8_dequantize(weight, scale, x.dtype)
        if groups == 1:
            return F.linear(x.view(rows, k), w).view(rows, 1, n)
        # the bf16 model's product; einsum's output is a permuted bmm result, the caller views it
        return torch.einsum("tgk,gnk->tgn", x, w.view(groups, n, k)).contiguous()
    decode = TILED_DECODE if path == "tiled" else {}
    cfg = {**_config(rows, n, k, groups, x.device), **decode, **tune}
    swap_ab = bool(cfg.pop("SWAP_AB", SWAP_AB_DEFAULT))
    assert FP8_BLOCK % cfg["BLOCK_K"] == 0, "a K step must sit in one scale block"
    split_len, splits = split_k(k, cfg["BLOCK_K"], cfg.pop("splits"))
    tiles = triton.cdiv(rows, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    fused = in_kernel_reduce(cfg, splits, tiles * groups)
    s, e8m0 = scale_operand(scale)
    # the scale on the dot's sums is exact only for power-of-two (UE8M0) scales
    post_scale = bool(cfg.pop("POST_SCALE", POST_SCALE_DEFAULT)) and e8m0
    out = split_output(y, splits)
    os = out.stride(0) if splits > 1 else 0
    on_gpu = x.is_cuda
    round_bf16 = x.dtype == torch.bfloat16 and not on_gpu
    _fp8_linear_kernel[(tiles, splits, groups)](
        x, weight, s, out, y, tile_counters(x.device) if fused else y,
        rows, n, k, split_len,
        x.stride(0), x.stride(1), weight.stride(0), s.stride(0), s.stride(1),
        os, out.stride(-3), out.stride(-2),
        SCALE_E8M0=e8m0, ROUND_W=round_bf16, ROUND_OUT=round_bf16 and (splits == 1 or fused),
        UPCAST=not on_gpu, POST_SCALE=post_scale, SWAP_AB=swap_ab, IN_KERNEL_REDUCE=fused,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **cfg,
    )  # fmt: skip
    if not fused:
        reduce_splits(out, y, round_bf16)
    return y


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               activations: str = "bf16", *, tune: dict | None = None) -> torch.Tensor:  # fmt: skip
    """x [..., K] bf16 (or fp32) @ W^T -> [..., N] in x.dtype; W = weight [N, K] e4m3 x scale
    [ceil(N/128), ceil(K/128)] (UE8M0 or fp32). `activations` "fp8": W8A8 above GEMV_MAX_ROWS
    (kernels/fp8_w8a8.py; CUBLAS: torch's block-scaled GEMM, `w8a8_path`). `tune`: config
    overrides (BLOCK_M/N/K, GROUP_M, num_warps, num_stages, splits, POST_SCALE, SWAP_AB, GEMV,
    W8A8, CUBLAS, FUSE_QUANT, DEQUANT; issue 21's
    candidates: STEP_BYTES, the row-tile GEMV; REDUCE "kernel", split-K partials added in the
    GEMM's own launch, kernels/fp8_splitk.py)."""
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, 1, k)
    if flat.stride(2) != 1:
        flat = flat.contiguous()
    return _launch(flat, weight, scale, tune, activations).view(*lead, weight.shape[0])


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       activations: str = "bf16", *, tune: dict | None = None) -> torch.Tensor:  # fmt: skip
    """x [..., G, K] -> [..., G, N]: group g through rows [g*N, (g+1)*N) of W = weight [G*N, K]
    e4m3 x scale, one launch (attn.wo_a)."""
    lead, (groups, k) = x.shape[:-2], x.shape[-2:]
    flat = x.reshape(-1, groups, k)
    if flat.stride(2) != 1:
        flat = flat.contiguous()
    y = _launch(flat, weight, scale, tune, activations)
    return y.view(*lead, groups, weight.shape[0] // groups)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   activations: str = "bf16") -> torch.Tensor:  # fmt: skip
    """Reference (and slow path): the model's op, dequantise the whole weight then F.linear."""
    return ref_fp8.fp8_linear(x, weight, scale, activations)


def fp8_grouped_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                           activations: str = "bf16") -> torch.Tensor:  # fmt: skip
    """Reference: the model's op, dequantise the whole weight then one einsum over groups."""
    return ref_fp8.fp8_grouped_linear(x, weight, scale, activations)


register_op("fp8_linear", fp8_linear, fp8_linear_ref, family="fp8_linear")
register_op("fp8_grouped_linear", fp8_grouped_linear, fp8_grouped_linear_ref,
            family="fp8_linear")  # fmt: skip
