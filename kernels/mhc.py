"""Manifold-constrained hyper-connections (mHC, docs/model.md#hyper-connections), fused.

hc_pre (per token, x̄ = vec(X) in fp32, M = 4 streams of D):
  ρ = rsqrt(mean(x̄²) + rms_eps); m = ρ·(F x̄) [24]; pre = σ(s₀m[:M]+b) + eps;
  post = 2σ(s₁m[M:2M]+b); C = Sinkhorn(s₂m[2M:]+b as M×M); u = Σ_i pre_i X_i.
Two launches. (A) the mixing GEMV F·x̄ and Σx̄², split along D over many programs when there are
few tokens so that the [24, 4D] weight is streamed by the whole GPU, not by one SM. Each program
loads one D chunk of all M streams at once (one memory round trip). Few tokens (T < 16, decode):
fp32 FMA on [BLOCK_T ≤ 4, 24, BLOCK_K] tiles, exact fp32. More tokens: tensor cores (tl.dot on
16-row tiles, 3xTF32 on GPU so the fp32 weights keep ~fp32 accuracy). (B) per token block and D
range: the split partials are summed, pre = σ(...) gives u for that D range; only D range 0 runs
post and the Sinkhorn (in registers on a [BLOCK_T, 8, 4] tile: rows 0/1 = pre/post logits,
rows 2..5 = the 4×4 comb). Decode-sized T runs (B) on one warp per token, so the 40 serial
Sinkhorn reductions are warp shuffles, not shared-memory round trips. With one split, (B) runs
inside (A)'s program (one launch, X re-read hits L2).
Sinkhorn order is exactly docs/model.md#hc_pre: row softmax, +eps, column-normalise, then (iters-1)
times row-normalise, column-normalise, every normalisation dividing by (sum + eps).

hc_head is the same kernel with 4 mixing rows and no post/comb. The first-layer path (#48137)
passes the embedding e [T, D] with stream stride 0, so the "four copies" are never written; it
also accepts F pre-folded over the streams ([24, D] = Σ_k F[:, kD:(k+1)D]). hc_post computes
X'_j = post_j·y + Σ_i C[i,j]·X_i in fp32 and takes X = e [T, D] (stride 0) for the first layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.registry import register_op
from kernels.specialize import sizes_vary

MAX_SPLITS = 64  # D splits of the GEMV; (B) holds [splits, BLOCK_T, BLOCK_N] partials in registers
DOT_MIN_TOKENS = 16  # from here on the GEMV uses tl.dot (16-row tiles are then full)
SMALL_FINISH_TOKENS = 64  # up to here (B) runs one token per single-warp program


@triton.jit
def _hc_partial_dot(x_ptr, fn_ptr, rows, row_ok, d_lo, d_hi, stride_xt, stride_xm, stride_fn, D,
                    N: tl.constexpr, BLOCK_N: tl.constexpr, M_LOOP: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr):  # fmt: skip
    # acc[t, n] = Σ_{m, d in [d_lo, d_hi)} x[t, m, d] · F[n, m·D + d];  sq[t] = Σ x²
    # D chunks outer, streams inner and unrolled: the software pipeliner issues a chunk's M
    # loads of x and F together (cp.async), so a one-chunk split is one memory round trip.
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)[None, :]
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xt
    for d0 in range(d_lo, d_hi, BLOCK_K):
        d = d0 + tl.arange(0, BLOCK_K)
        d_ok = d < d_hi
        for m in tl.static_range(M_LOOP):
            x = tl.load(x_rows + m * stride_xm + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                        other=0.0).to(tl.float32)  # fmt: skip
            f = tl.load(fn_ptr + n * stride_fn + (m * D + d)[:, None],
                        mask=d_ok[:, None] & (n < N), other=0.0)  # fmt: skip
            acc = tl.dot(x, f, acc, input_precision=PRECISION)  # x [T, K] @ f [K, N]
            sq += x * x
    return acc, tl.sum(sq, axis=1)


@triton.jit
def _hc_partial_fma(x_ptr, fn_ptr, rows, row_ok, d_lo, d_hi, stride_xt, stride_xm, stride_fn, D,
                    N: tl.constexpr, BLOCK_N: tl.constexpr, M_LOOP: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    # Same sums as _hc_partial_dot in exact fp32 FMA, on [BLOCK_T, M_LOOP, BLOCK_N, BLOCK_K]
    # tiles: one load each for x and F covering every stream, so that all of a chunk's loads are
    # in flight before the first FMA (per-stream loads get serialised behind their FMAs).
    acc = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_K], dtype=tl.float32)  # Σ over K after the loop
    sq = tl.zeros([BLOCK_T, 1, BLOCK_K], dtype=tl.float32)
    m = tl.arange(0, M_LOOP)[None, :, None, None]
    n = tl.arange(0, BLOCK_N)[None, None, :, None]
    x_rows = x_ptr + rows.to(tl.int64)[:, None, None, None] * stride_xt + m * stride_xm
    t_ok = row_ok[:, None, None, None]
    for d0 in range(d_lo, d_hi, BLOCK_K):
        d = d0 + tl.arange(0, BLOCK_K)[None, None, None, :]
        x = tl.load(x_rows + d, mask=t_ok & (d < d_hi), other=0.0).to(tl.float32)  # [T, M, 1, K]
        f = tl.load(fn_ptr + n * stride_fn + m * D + d, mask=(n < N) & (d < d_hi), other=0.0)
        acc += tl.sum(x * f, axis=1)
        sq += tl.sum(x * x, axis=1)
    return tl.sum(acc, axis=2), tl.sum(tl.sum(sq, axis=2), axis=1)


@triton.jit
def _hc_gate(mix_pre, scale_ptr, base_ptr, eps, M: tl.constexpr):
    # pre[t, i] = σ(s₀·ρm[t, i] + b[i]) + eps; mix_pre = ρm[:, :M] [BLOCK_T, M]
    b = tl.load(base_ptr + tl.arange(0, M))
    return tl.sigmoid(mix_pre * tl.load(scale_ptr) + b[None, :]) + eps


@triton.jit
def _hc_post_comb(mix, rows, row_ok, scale_ptr, base_ptr, post_ptr, comb_ptr, iters, eps,
                  M: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_T: tl.constexpr):  # fmt: skip
    # mix = ρm [BLOCK_T, BLOCK_N] seen as [BLOCK_T, R, M]: row 1 = post logits, rows 2..M+1 the
    # comb logits C[i = r-2, j]; writes post [T, M] and comb [T, M, M].
    R: tl.constexpr = BLOCK_N // M
    r = tl.arange(0, R)[None, :, None]
    j = tl.arange(0, M)[None, None, :]
    z_base = tl.load(base_ptr + r * M + j, mask=r * M + j < N, other=0.0)
    s12 = tl.where(r == 1, tl.load(scale_ptr + 1), tl.load(scale_ptr + 2))
    z = tl.reshape(mix, [BLOCK_T, R, M]) * s12 + z_base
    t_ok = row_ok[:, None, None]
    post = 2.0 * tl.sigmoid(z)
    tl.store(post_ptr + rows[:, None, None] * M + (r * 0 + j), post, mask=t_ok & (r == 1))
    is_c = (r >= 2) & (r < 2 + M)
    zc = tl.where(is_c, z, 0.0)
    e = tl.exp(zc - tl.max(zc, axis=2)[:, :, None])
    c = tl.where(is_c, e / tl.sum(e, axis=2)[:, :, None] + eps, 0.0)
    c = c / (tl.sum(c, axis=1)[:, None, :] + eps)  # column sums (over i)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + eps)  # row sums (over j)
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    c_off = rows[:, None, None] * (M * M) + (r - 2) * M + j
    tl.store(comb_ptr + c_off, c, mask=t_ok & is_c)


@triton.jit
def _hc_load_x(x_ptr, rows, row_ok, d0, d_hi, stride_xt, stride_xm, M: tl.constexpr,
               BLOCK_D: tl.constexpr):  # fmt: skip
    # x[rows, :, d0 : d0 + BLOCK_D] -> [BLOCK_T, M, BLOCK_D] fp32 (0 outside [d0, d_hi))
    i = tl.arange(0, M)[None, :, None]
    d = d0 + tl.arange(0, BLOCK_D)[None, None, :]
    ptrs = x_ptr + rows.to(tl.int64)[:, None, None] * stride_xt + i * stride_xm + d
    return tl.load(ptrs, mask=row_ok[:, None, None] & (d < d_hi), other=0.0).to(tl.float32)


@triton.jit
def _hc_collapse(pre, x0, rows, row_ok, x_ptr, u_ptr, D, d_lo, d_hi, stride_xt, stride_xm,
                 M: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    # u[t, d] = Σ_i pre[t, i] · x[t, i, d] for d in [d_lo, d_hi), fp32; x0 = chunk at d_lo,
    # loaded by the caller early so that its latency hides behind the gate/Sinkhorn math.
    u_rows = u_ptr + rows.to(tl.int64)[:, None] * D
    dd = tl.arange(0, BLOCK_D)
    x = x0
    for d0 in range(d_lo, d_hi, BLOCK_D):
        if d0 > d_lo:
            x = _hc_load_x(x_ptr, rows, row_ok, d0, d_hi, stride_xt, stride_xm, M, BLOCK_D)
        u = tl.sum(pre[:, :, None] * x, axis=1)
        d = d0 + dd
        tl.store(u_rows + d[None, :], u.to(u_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (d < d_hi)[None, :])  # fmt: skip


@triton.jit(**sizes_vary("T", "d_per_split"))
def _hc_pre_kernel(
    # Pointers: x [T, M, D] (stride_xm may be 0), fn [N, K_F] fp32, scale, base; outputs u [T, D],
    # post [T, M], comb [T, M, M]; partial workspaces [SPLITS, T, BLOCK_N] and [SPLITS, T]
    x_ptr, fn_ptr, scale_ptr, base_ptr, u_ptr, post_ptr, comb_ptr, part_ptr, part_sq_ptr,
    # Sizes, strides (elements), scalars
    T, D, d_per_split, inv_k, stride_xt, stride_xm, stride_fn, iters, eps, rms_eps,
    # Meta-parameters
    M: tl.constexpr, M_LOOP: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, IS_HEAD: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    split = tl.program_id(1)
    d_lo = split * d_per_split
    d_hi = tl.minimum(D, d_lo + d_per_split)
    if USE_DOT:
        acc, sq = _hc_partial_dot(x_ptr, fn_ptr, rows, row_ok, d_lo, d_hi, stride_xt, stride_xm,
                                  stride_fn, D, N, BLOCK_N, M_LOOP, BLOCK_T, BLOCK_K,
                                  PRECISION)  # fmt: skip
    else:
        acc, sq = _hc_partial_fma(x_ptr, fn_ptr, rows, row_ok, d_lo, d_hi, stride_xt, stride_xm,
                                  stride_fn, D, N, BLOCK_N, M_LOOP, BLOCK_T, BLOCK_K)  # fmt: skip
    if WRITE_PARTIAL:
        n = tl.arange(0, BLOCK_N)
        p_off = (split * T + rows)[:, None] * BLOCK_N + n[None, :]
        tl.store(part_ptr + p_off, acc, mask=row_ok[:, None])
        tl.store(part_sq_ptr + split * T + rows, sq, mask=row_ok)
    else:  # one split: this program owns its tokens' whole D range
        x0 = _hc_load_x(x_ptr, rows, row_ok, 0, D, stride_xt, stride_xm, M, BLOCK_D)
        mix = acc * tl.rsqrt(sq * inv_k + rms_eps)[:, None]
        r = tl.arange(0, BLOCK_N // M)[None, :, None]
        mix_pre = tl.sum(tl.where(r == 0, tl.reshape(mix, [BLOCK_T, BLOCK_N // M, M]), 0.0), 1)
        if not IS_HEAD:
            _hc_post_comb(mix, rows, row_ok, scale_ptr, base_ptr, post_ptr, comb_ptr, iters, eps,
                          M, N, BLOCK_N, BLOCK_T)  # fmt: skip
        pre = _hc_gate(mix_pre, scale_ptr, base_ptr, eps, M)
        _hc_collapse(pre, x0, rows, row_ok, x_ptr, u_ptr, D, 0, D, stride_xt, stride_xm, M,
                     BLOCK_D)  # fmt: skip


@triton.jit(**sizes_vary("T", "num_splits"))
def _hc_finish_kernel(
    # Grid (token blocks, D chunks of BLOCK_D): every program sums its tokens' split partials of
    # the M pre logits and collapses its D chunk; chunk 0 alone also sums all BLOCK_N mixes and
    # writes post/comb, so one program per token block runs the Sinkhorn.
    x_ptr, scale_ptr, base_ptr, u_ptr, post_ptr, comb_ptr, part_ptr, part_sq_ptr,
    T, D, num_splits, inv_k, stride_xt, stride_xm, iters, eps, rms_eps,
    M: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, IS_HEAD: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    pid_d = tl.program_id(1)
    d_lo = pid_d * BLOCK_D
    d_hi = tl.minimum(D, d_lo + BLOCK_D)
    # All loads first (x, then partials [BLOCK_S, BLOCK_T, ·]) so that their latencies overlap.
    x0 = _hc_load_x(x_ptr, rows, row_ok, d_lo, d_hi, stride_xt, stride_xm, M, BLOCK_D)
    s = tl.arange(0, BLOCK_S)
    p_row = (s[:, None] * T + rows[None, :])[:, :, None]  # [BLOCK_S, BLOCK_T, 1]
    p_ok = ((s < num_splits)[:, None] & row_ok[None, :])[:, :, None]
    sq = tl.sum(tl.load(part_sq_ptr + p_row, mask=p_ok, other=0.0), axis=0)  # [BLOCK_T, 1]
    j = tl.arange(0, M)[None, None, :]
    mix_pre = tl.sum(tl.load(part_ptr + p_row * BLOCK_N + j, mask=p_ok, other=0.0), axis=0)
    if not IS_HEAD:  # all BLOCK_N mixes, for chunk 0 only: the mask is block-shaped because
        n = tl.arange(0, BLOCK_N)[None, None, :]  # the interpreter cannot AND a scalar into it
        first = p_ok & ((n * 0 + pid_d) == 0)
        mix = tl.sum(tl.load(part_ptr + p_row * BLOCK_N + n, mask=first, other=0.0), axis=0)
    rho = tl.rsqrt(sq * inv_k + rms_eps)
    pre = _hc_gate(mix_pre * rho, scale_ptr, base_ptr, eps, M)
    _hc_collapse(pre, x0, rows, row_ok, x_ptr, u_ptr, D, d_lo, d_hi, stride_xt, stride_xm, M,
                 BLOCK_D)  # fmt: skip
    if not IS_HEAD:  # noqa: SIM102 (compile-time test first: `mix` exists only when not IS_HEAD)
        if pid_d == 0:  # after the collapse, so x0's registers are free for the Sinkhorn
            _hc_post_comb(mix * rho, rows, row_ok, scale_ptr, base_ptr, post_ptr, comb_ptr, iters,
                          eps, M, N, BLOCK_N, BLOCK_T)  # fmt: skip


def _mix_config(num_tokens, hidden, n_mix, block_k=None, use_dot=None):
    """Launch configuration of hc_pre / hc_head (same on CPU and GPU, so the interpreter tests
    run what the GPU runs). `block_k` / `use_dot` (tests) force the D chunk / the GEMV path."""
    use_dot = num_tokens >= DOT_MIN_TOKENS if use_dot is None else use_dot
    if use_dot:  # tl.dot needs >= 16 rows and columns
        block_t, block_n = 16, max(16, triton.next_power_of_2(n_mix))
    else:  # [BLOCK_T, M, BLOCK_N, BLOCK_K] product tile: BLOCK_T ≤ 4 keeps it in registers
        block_t, block_n = min(triton.next_power_of_2(num_tokens), 4), triton.next_power_of_2(n_mix)
    block_k = block_k or 64  # sm_90, 4 warps: no register spills on either path
    t_blocks = triton.cdiv(num_tokens, block_t)
    k_chunks = triton.cdiv(hidden, block_k)
    small = num_tokens <= SMALL_FINISH_TOKENS  # (B): one warp per token, no smem reductions
    fin_t, block_d, fin_warps = (1, 256, 1) if small else (16, 128, 4)
    # ~2 waves of the H200's 132 SMs; at decode sizes every split is one chunk (one round trip).
    # (B) with 16 tokens holds [splits, 16, BLOCK_N] partials: ≤ 32 splits to avoid spills.
    max_splits = MAX_SPLITS if small else MAX_SPLITS // 2
    num_splits = min(k_chunks, triton.cdiv(264, t_blocks), max_splits)
    d_per_split = triton.cdiv(k_chunks, num_splits) * block_k
    return dict(
        use_dot=use_dot, block_t=block_t, block_n=block_n, block_k=block_k,
        num_splits=triton.cdiv(hidden, d_per_split), d_per_split=d_per_split,
        fin_t=fin_t, block_d=block_d, fin_warps=fin_warps,
    )  # fmt: skip


def _launch_mix(x, stride_xm, hidden, fn, scale, base, iters, eps, rms_eps, *, is_head, m,
                block_k, use_dot):  # fmt: skip
    """Shared host path of hc_pre / hc_head / hc_pre_first_layer. x: [T, M, D] or [T, D]."""
    num_tokens = x.shape[0]
    n_mix = fn.shape[0]
    m_loop = fn.shape[1] // hidden  # 1 when fn is pre-folded over the streams
    assert fn.dtype == torch.float32 and fn.shape[1] == m_loop * hidden and m_loop in (1, m)
    assert base.shape == (n_mix,) and scale.numel() == (1 if is_head else 3)
    dev = x.device
    u = torch.empty(num_tokens, hidden, dtype=x.dtype, device=dev)
    post = torch.empty(num_tokens, m, dtype=torch.float32, device=dev)
    comb = torch.empty(num_tokens, m, m, dtype=torch.float32, device=dev)
    if num_tokens == 0:
        return u, post, comb
    cfg = _mix_config(num_tokens, hidden, n_mix, block_k, use_dot)
    num_splits, block_n = cfg["num_splits"], cfg["block_n"]
    fn, scale, base = fn.contiguous(), scale.float().contiguous(), base.float().contiguous()
    part = torch.empty(num_splits, num_tokens, block_n, dtype=torch.float32, device=dev)
    part_sq = torch.empty(num_splits, num_tokens, dtype=torch.float32, device=dev)
    inv_k = 1.0 / (m_loop * hidden)
    common = dict(M=m, N=n_mix, BLOCK_N=block_n, BLOCK_D=cfg["block_d"], IS_HEAD=is_head)
    _hc_pre_kernel[(triton.cdiv(num_tokens, cfg["block_t"]), num_splits)](
        x, fn, scale, base, u, post, comb, part, part_sq,
        num_tokens, hidden, cfg["d_per_split"], inv_k, x.stride(0), stride_xm, fn.stride(0),
        iters, eps, rms_eps, M_LOOP=m_loop, BLOCK_T=cfg["block_t"], BLOCK_K=cfg["block_k"],
        WRITE_PARTIAL=num_splits > 1, USE_DOT=cfg["use_dot"],
        PRECISION="tf32x3" if x.is_cuda else "ieee", num_warps=4, **common,
    )  # fmt: skip
    if num_splits > 1:
        grid = (triton.cdiv(num_tokens, cfg["fin_t"]), triton.cdiv(hidden, cfg["block_d"]))
        _hc_finish_kernel[grid](
            x, scale, base, u, post, comb, part, part_sq,
            num_tokens, hidden, num_splits, inv_k, x.stride(0), stride_xm,
            iters, eps, rms_eps, BLOCK_T=cfg["fin_t"],
            BLOCK_S=triton.next_power_of_2(num_splits), num_warps=cfg["fin_warps"], **common,
        )  # fmt: skip
    return u, post, comb


def hc_pre(x, fn, scale, base, iters, eps, rms_eps, *, block_k=None, use_dot=None):
    """x [T, M, D] bf16/fp32, fn [(2+M)M, MD] fp32, scale [3], base [(2+M)M] fp32.

    Returns u [T, D] (x.dtype), post [T, M] fp32, comb [T, M, M] fp32 (C[i, j]).
    `block_k` (tests) sets the D-chunk of the mixing GEMV, hence how many splits run;
    `use_dot` (tests) forces the tensor-core (True) or FMA (False) GEMV path.
    """
    assert x.dim() == 3 and x.stride(2) == 1, x.shape
    m = x.shape[1]
    assert fn.shape == ((2 + m) * m, m * x.shape[2]), fn.shape
    return _launch_mix(x, x.stride(1), x.shape[2], fn, scale, base, iters, eps, rms_eps,
                       is_head=False, m=m, block_k=block_k, use_dot=use_dot)  # fmt: skip


def hc_pre_first_layer(e, fn, scale, base, iters, eps, rms_eps, *, block_k=None, use_dot=None):
    """hc_pre of X = [e, e, ..., e] (M copies) without materialising X (#48137).

    e [T, D]; fn [(2+M)M, MD] fp32, or pre-folded over the streams [(2+M)M, D]. Same outputs as
    `hc_pre`. The residual for the first hc_post is e itself: `hc_post(y, e, post, comb)`.
    """
    assert e.dim() == 2 and e.stride(1) == 1, e.shape
    m = _num_streams(fn.shape[0])
    return _launch_mix(e, 0, e.shape[1], fn, scale, base, iters, eps, rms_eps,
                       is_head=False, m=m, block_k=block_k, use_dot=use_dot)  # fmt: skip


def hc_head(x, fn, scale, base, eps, rms_eps, *, block_k=None, use_dot=None):
    """x [T, M, D], fn [M, MD] fp32, scale [1], base [M] -> h [T, D] (x.dtype)."""
    assert x.dim() == 3 and x.stride(2) == 1, x.shape
    m = x.shape[1]
    assert fn.shape == (m, m * x.shape[2]), fn.shape
    u, _, _ = _launch_mix(x, x.stride(1), x.shape[2], fn, scale, base, 1, eps, rms_eps,
                          is_head=True, m=m, block_k=block_k, use_dot=use_dot)  # fmt: skip
    return u


def _num_streams(n_mix: int) -> int:
    m = 1
    while (2 + m) * m < n_mix:
        m += 1
    assert (2 + m) * m == n_mix, n_mix
    return m


@triton.jit(**sizes_vary("T"))
def _hc_post_kernel(
    # Pointers: y [T, D], x [T, M, D] (stride_xm 0 for the first layer), post [T, M],
    # comb [T, M, M]; output out [T, M, D] contiguous
    y_ptr, x_ptr, post_ptr, comb_ptr, out_ptr,
    # Sizes, strides (elements)
    T, D, stride_yt, stride_xt, stride_xm,
    # Meta-parameters
    M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < T
    mask = row_ok[:, None] & (d < D)[None, :]
    r64 = rows.to(tl.int64)
    j = tl.arange(0, M)
    y = tl.load(y_ptr + r64[:, None] * stride_yt + d[None, :], mask=mask, other=0.0)
    post = tl.load(post_ptr + rows[:, None] * M + j[None, :], mask=row_ok[:, None], other=0.0)
    out = post[:, :, None] * y.to(tl.float32)[:, None, :]  # [BLOCK_T, M(j), BLOCK_D]
    for i in tl.static_range(M):
        xi = tl.load(x_ptr + r64[:, None] * stride_xt + i * stride_xm + d[None, :], mask=mask,
                     other=0.0).to(tl.float32)  # fmt: skip
        ci = tl.load(comb_ptr + rows[:, None] * (M * M) + i * M + j[None, :],
                     mask=row_ok[:, None], other=0.0)  # fmt: skip
        out += ci[:, :, None] * xi[:, None, :]
    o_off = r64[:, None, None] * (M * D) + j[None, :, None] * D + d[None, None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=mask[:, None, :])


def hc_post(y, x, post, comb):
    """X'_j = post_j·y + Σ_i C[i, j]·X_i, fp32 math, output in x.dtype.

    y [T, D], x [T, M, D] (or the first layer's e [T, D] standing for M equal streams),
    post [T, M] fp32, comb [T, M, M] fp32 -> x_new [T, M, D].
    """
    m = post.shape[1]
    num_tokens, hidden = y.shape
    stride_xm = x.stride(1) if x.dim() == 3 else 0
    assert x.shape[0] == num_tokens and x.shape[-1] == hidden and x.stride(-1) == 1
    assert y.stride(1) == 1 and comb.shape == (num_tokens, m, m)
    out = torch.empty(num_tokens, m, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    on_gpu = x.is_cuda
    block_t = 1 if on_gpu else min(16, triton.next_power_of_2(num_tokens))
    block_d = 512 if on_gpu else min(1024, triton.next_power_of_2(hidden))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(hidden, block_d))
    _hc_post_kernel[grid](
        y, x, post.float().contiguous(), comb.float().contiguous(), out,
        num_tokens, hidden, y.stride(0), x.stride(0), stride_xm,
        M=m, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------- references


def _sinkhorn_ref(c0: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    c = torch.softmax(c0, dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def _mixes_ref(x, fn, rms_eps):
    xf = x.flatten(1).float()  # [T, MD]
    rho = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + rms_eps)
    return (xf @ fn.float().t()) * rho


def hc_pre_ref(x, fn, scale, base, iters, eps, rms_eps):
    """Reference (and unfused slow path) of `hc_pre`, docs/model.md#hc_pre verbatim."""
    num_tokens, m, _ = x.shape
    z = _mixes_ref(x, fn, rms_eps)
    scale, base = scale.float(), base.float()
    pre = torch.sigmoid(z[:, :m] * scale[0] + base[:m]) + eps
    post = 2 * torch.sigmoid(z[:, m : 2 * m] * scale[1] + base[m : 2 * m])
    c0 = (z[:, 2 * m :] * scale[2] + base[2 * m :]).view(num_tokens, m, m)
    comb = _sinkhorn_ref(c0, iters, eps)
    u = (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)
    return u, post, comb


def hc_pre_first_layer_ref(e, fn, scale, base, iters, eps, rms_eps):
    """hc_pre_ref of e repeated M times (fn unfolded [(2+M)M, MD])."""
    m = _num_streams(fn.shape[0])
    return hc_pre_ref(e.unsqueeze(1).expand(-1, m, -1), fn, scale, base, iters, eps, rms_eps)


def hc_head_ref(x, fn, scale, base, eps, rms_eps):
    """Reference of `hc_head` (docs/model.md#hc_head)."""
    a = torch.sigmoid(_mixes_ref(x, fn, rms_eps) * scale.float()[0] + base.float()) + eps
    return (a.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)


def hc_post_ref(y, x, post, comb):
    """Reference of `hc_post` (docs/model.md#hc_post); x may be [T, D] (M equal streams)."""
    m = post.shape[1]
    xf = x.float() if x.dim() == 3 else x.float().unsqueeze(1).expand(-1, m, -1)
    out = post.float().unsqueeze(-1) * y.float().unsqueeze(1) + comb.float().transpose(1, 2) @ xf
    return out.to(x.dtype)


def hc_pre_first_layer_repeat(e, fn, scale, base, iters, eps, rms_eps):
    """The pre-#48137 slow path: materialise the M copies, then the standalone fused hc_pre."""
    m = _num_streams(fn.shape[0])
    return hc_pre(e.unsqueeze(1).repeat(1, m, 1), fn, scale, base, iters, eps, rms_eps)


register_op("hc_pre", hc_pre, hc_pre_ref, family="mhc")
register_op(
    "hc_pre_first_layer",
    hc_pre_first_layer,
    hc_pre_first_layer_ref,
    family="mhc",
    baseline_fn=hc_pre_first_layer_repeat,
)
register_op("hc_post", hc_post, hc_post_ref, family="mhc")
register_op("hc_head", hc_head, hc_head_ref, family="mhc")
