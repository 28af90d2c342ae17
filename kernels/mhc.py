"""Manifold-constrained hyper-connections (mHC, DSV4_ARCH.md §4), fused.

hc_pre (per token, x̄ = vec(X) in fp32, M = 4 streams of D):
  ρ = rsqrt(mean(x̄²) + rms_eps); m = ρ·(F x̄) [24]; pre = σ(s₀m[:M]+b) + eps;
  post = 2σ(s₁m[M:2M]+b); C = Sinkhorn(s₂m[2M:]+b as M×M); u = Σ_i pre_i X_i.
Two launches: (A) the mixing GEMV F·x̄ and Σx̄² on tensor cores (tl.dot, 3xTF32 on GPU so
the fp32 weights keep ~fp32 accuracy), split along D over several programs when there are few
tokens so that the [24, 4D] weight is streamed by the whole GPU, not by one SM; (B) per block of
tokens: the split partials are summed, sigmoid/softmax/Sinkhorn run in registers on a
[BLOCK_T, 8, 4] tile (rows 0/1 = pre/post logits, rows 2..5 = the 4×4 comb), then X is re-read
for u. With one split, (B) runs inside (A)'s program (one launch, X re-read hits L2).
Sinkhorn order is exactly §4.2: row softmax, +eps, column-normalise, then (iters-1) times
row-normalise, column-normalise, every normalisation dividing by (sum + eps).

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


@triton.jit
def _hc_partial(x_ptr, fn_ptr, rows, row_ok, d_lo, d_hi, stride_xt, stride_xm, stride_fn, D,
                N: tl.constexpr, BLOCK_N: tl.constexpr, M_LOOP: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    # acc[t, n] = Σ_{m, d in [d_lo, d_hi)} x[t, m, d] · F[n, m·D + d];  sq[t] = Σ x²
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xt
    for m in tl.static_range(M_LOOP):
        for d0 in range(d_lo, d_hi, BLOCK_K):
            d = d0 + kk
            d_ok = d < d_hi
            x = tl.load(x_rows + m * stride_xm + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                        other=0.0).to(tl.float32)  # fmt: skip
            f = tl.load(fn_ptr + n[None, :] * stride_fn + (m * D + d)[:, None],
                        mask=d_ok[:, None] & (n < N)[None, :], other=0.0)  # fmt: skip
            acc = tl.dot(x, f, acc, input_precision=PRECISION)
            sq += tl.sum(x * x, axis=1)
    return acc, sq


@triton.jit
def _hc_finish(acc, sq, rows, row_ok, x_ptr, scale_ptr, base_ptr, u_ptr, post_ptr, comb_ptr,
               D, d_lo, d_hi, d_prog, inv_k, stride_xt, stride_xm, iters, eps, rms_eps,
               M: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
               BLOCK_D: tl.constexpr, IS_HEAD: tl.constexpr):  # fmt: skip
    R: tl.constexpr = BLOCK_N // M
    rho = tl.rsqrt(sq * inv_k + rms_eps)
    mix = tl.reshape(acc * rho[:, None], [BLOCK_T, R, M])  # row r holds mixes r·M .. r·M+M-1
    r = tl.arange(0, R)[None, :, None]
    j = tl.arange(0, M)[None, None, :]
    z_base = tl.load(base_ptr + r * M + j, mask=r * M + j < N, other=0.0)
    s0 = tl.load(scale_ptr)
    if IS_HEAD:
        z = mix * s0 + z_base
    else:
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        z = mix * tl.where(r == 0, s0, tl.where(r == 1, s1, s2)) + z_base
    sig = tl.sigmoid(z)
    pre = tl.sum(tl.where(r == 0, sig + eps, 0.0), axis=1)  # [BLOCK_T, M]
    t_ok = row_ok[:, None, None]
    writes = row_ok & ((rows * 0 + d_prog) == 0)  # D range 0 writes post/comb (block-shaped:
    if not IS_HEAD:  # the interpreter cannot AND a scalar bool into a mask)
        post = tl.sum(tl.where(r == 1, 2.0 * sig, 0.0), axis=1)
        mj = tl.arange(0, M)[None, :]
        tl.store(post_ptr + rows[:, None] * M + mj, post, mask=writes[:, None])
        is_c = (r >= 2) & (r < 2 + M)  # the M×M comb rows C[i = r-2, j]
        zc = tl.where(is_c, z, 0.0)
        e = tl.exp(zc - tl.max(zc, axis=2)[:, :, None])
        c = tl.where(is_c, e / tl.sum(e, axis=2)[:, :, None] + eps, 0.0)
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)  # column sums (over i)
        for _ in range(iters - 1):
            c = c / (tl.sum(c, axis=2)[:, :, None] + eps)  # row sums (over j)
            c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
        c_off = rows[:, None, None] * (M * M) + (r - 2) * M + j
        tl.store(comb_ptr + c_off, c, mask=writes[:, None, None] & is_c)
    # u[t, d] = Σ_i pre[t, i] · x[t, i, d] for d in [d_lo, d_hi), fp32 accumulate
    i3 = tl.arange(0, M)[None, :, None]
    dd = tl.arange(0, BLOCK_D)
    x_rows = x_ptr + rows.to(tl.int64)[:, None, None] * stride_xt + i3 * stride_xm
    for d0 in range(d_lo, d_hi, BLOCK_D):
        d = d0 + dd
        x = tl.load(x_rows + d[None, None, :], mask=t_ok & (d < d_hi)[None, None, :], other=0.0)
        u = tl.sum(pre[:, :, None] * x.to(tl.float32), axis=1)
        u_mask = row_ok[:, None] & (d < d_hi)[None, :]
        tl.store(u_ptr + rows.to(tl.int64)[:, None] * D + d[None, :],
                 u.to(u_ptr.dtype.element_ty), mask=u_mask)  # fmt: skip


@triton.jit
def _hc_pre_kernel(
    # Pointers: x [T, M, D] (stride_xm may be 0), fn [N, K_F] fp32, scale, base; outputs u [T, D],
    # post [T, M], comb [T, M, M]; partial workspaces [SPLITS, T, BLOCK_N] and [SPLITS, T]
    x_ptr, fn_ptr, scale_ptr, base_ptr, u_ptr, post_ptr, comb_ptr, part_ptr, part_sq_ptr,
    # Sizes, strides (elements), scalars
    T, D, d_per_split, inv_k, stride_xt, stride_xm, stride_fn, iters, eps, rms_eps,
    # Meta-parameters
    M: tl.constexpr, M_LOOP: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_HEAD: tl.constexpr, WRITE_PARTIAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    split = tl.program_id(1)
    d_lo = split * d_per_split
    d_hi = tl.minimum(D, d_lo + d_per_split)
    acc, sq = _hc_partial(x_ptr, fn_ptr, rows, row_ok, d_lo, d_hi, stride_xt, stride_xm,
                          stride_fn, D, N, BLOCK_N, M_LOOP, BLOCK_T, BLOCK_K, PRECISION)  # fmt: skip
    if WRITE_PARTIAL:
        n = tl.arange(0, BLOCK_N)
        p_off = (split * T + rows)[:, None] * BLOCK_N + n[None, :]
        tl.store(part_ptr + p_off, acc, mask=row_ok[:, None])
        tl.store(part_sq_ptr + split * T + rows, sq, mask=row_ok)
    else:
        _hc_finish(acc, sq, rows, row_ok, x_ptr, scale_ptr, base_ptr, u_ptr, post_ptr, comb_ptr,
                   D, 0, D, split, inv_k, stride_xt, stride_xm, iters, eps, rms_eps,
                   M, N, BLOCK_N, BLOCK_T, BLOCK_D, IS_HEAD)  # fmt: skip


@triton.jit
def _hc_finish_kernel(
    # Grid (token blocks, D ranges): every program sums the split partials of its tokens and
    # runs the (cheap) Sinkhorn again, then collapses its own D range; D range 0 writes post/comb.
    x_ptr, scale_ptr, base_ptr, u_ptr, post_ptr, comb_ptr, part_ptr, part_sq_ptr,
    T, D, num_splits, d_per_prog, inv_k, stride_xt, stride_xm, iters, eps, rms_eps,
    M: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, IS_HEAD: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    n = tl.arange(0, BLOCK_N)
    s = tl.arange(0, BLOCK_S)
    s_ok = (s < num_splits)[:, None]
    p_off = s[:, None] * T + rows[None, :]  # [BLOCK_S, BLOCK_T]
    parts = tl.load(part_ptr + p_off[:, :, None] * BLOCK_N + n[None, None, :],
                    mask=(s_ok & row_ok[None, :])[:, :, None], other=0.0)  # fmt: skip
    acc = tl.sum(parts, axis=0)
    sq = tl.sum(tl.load(part_sq_ptr + p_off, mask=s_ok & row_ok[None, :], other=0.0), axis=0)
    pid_d = tl.program_id(1)
    d_lo = pid_d * d_per_prog
    d_hi = tl.minimum(D, d_lo + d_per_prog)
    _hc_finish(acc, sq, rows, row_ok, x_ptr, scale_ptr, base_ptr, u_ptr, post_ptr, comb_ptr,
               D, d_lo, d_hi, pid_d, inv_k, stride_xt, stride_xm, iters, eps, rms_eps,
               M, N, BLOCK_N, BLOCK_T, BLOCK_D, IS_HEAD)  # fmt: skip


def _launch_mix(x, stride_xm, hidden, fn, scale, base, iters, eps, rms_eps, *, is_head, m, block_k):
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
    on_gpu = x.is_cuda
    block_n = max(16, triton.next_power_of_2(n_mix))
    block_t = 16  # tl.dot needs >= 16 rows
    block_k = block_k or (128 if on_gpu else min(1024, triton.next_power_of_2(hidden)))
    block_d = 128 if on_gpu else block_k
    t_blocks = triton.cdiv(num_tokens, block_t)
    k_chunks = triton.cdiv(hidden, block_k)
    num_splits = min(k_chunks, triton.cdiv(264, t_blocks), 16) if on_gpu else min(k_chunks, 2)
    d_per_split = triton.cdiv(k_chunks, num_splits) * block_k
    num_splits = triton.cdiv(hidden, d_per_split)
    fn, scale, base = fn.contiguous(), scale.float().contiguous(), base.float().contiguous()
    part = torch.empty(num_splits, num_tokens, block_n, dtype=torch.float32, device=dev)
    part_sq = torch.empty(num_splits, num_tokens, dtype=torch.float32, device=dev)
    inv_k = 1.0 / (m_loop * hidden)
    common = dict(M=m, N=n_mix, BLOCK_N=block_n, BLOCK_T=block_t, BLOCK_D=block_d,
                  IS_HEAD=is_head, num_warps=4)  # fmt: skip
    _hc_pre_kernel[(t_blocks, num_splits)](
        x, fn, scale, base, u, post, comb, part, part_sq,
        num_tokens, hidden, d_per_split, inv_k, x.stride(0), stride_xm, fn.stride(0),
        iters, eps, rms_eps, M_LOOP=m_loop, BLOCK_K=block_k, WRITE_PARTIAL=num_splits > 1,
        PRECISION="tf32x3" if on_gpu else "ieee", **common,
    )  # fmt: skip
    if num_splits > 1:
        d_progs = min(triton.cdiv(hidden, block_d), triton.cdiv(264, t_blocks))
        d_per_prog = triton.cdiv(triton.cdiv(hidden, block_d), d_progs) * block_d
        _hc_finish_kernel[(t_blocks, triton.cdiv(hidden, d_per_prog))](
            x, scale, base, u, post, comb, part, part_sq,
            num_tokens, hidden, num_splits, d_per_prog, inv_k, x.stride(0), stride_xm,
            iters, eps, rms_eps, BLOCK_S=triton.next_power_of_2(num_splits), **common,
        )  # fmt: skip
    return u, post, comb


def hc_pre(x, fn, scale, base, iters, eps, rms_eps, *, block_k=None):
    """x [T, M, D] bf16/fp32, fn [(2+M)M, MD] fp32, scale [3], base [(2+M)M] fp32.

    Returns u [T, D] (x.dtype), post [T, M] fp32, comb [T, M, M] fp32 (C[i, j]).
    `block_k` (tests) sets the D-chunk of the mixing GEMV, hence how many splits run.
    """
    assert x.dim() == 3 and x.stride(2) == 1, x.shape
    m = x.shape[1]
    assert fn.shape == ((2 + m) * m, m * x.shape[2]), fn.shape
    return _launch_mix(x, x.stride(1), x.shape[2], fn, scale, base, iters, eps, rms_eps,
                       is_head=False, m=m, block_k=block_k)  # fmt: skip


def hc_pre_first_layer(e, fn, scale, base, iters, eps, rms_eps, *, block_k=None):
    """hc_pre of X = [e, e, ..., e] (M copies) without materialising X (#48137).

    e [T, D]; fn [(2+M)M, MD] fp32, or pre-folded over the streams [(2+M)M, D]. Same outputs as
    `hc_pre`. The residual for the first hc_post is e itself: `hc_post(y, e, post, comb)`.
    """
    assert e.dim() == 2 and e.stride(1) == 1, e.shape
    m = _num_streams(fn.shape[0])
    return _launch_mix(e, 0, e.shape[1], fn, scale, base, iters, eps, rms_eps,
                       is_head=False, m=m, block_k=block_k)  # fmt: skip


def hc_head(x, fn, scale, base, eps, rms_eps, *, block_k=None):
    """x [T, M, D], fn [M, MD] fp32, scale [1], base [M] -> h [T, D] (x.dtype)."""
    assert x.dim() == 3 and x.stride(2) == 1, x.shape
    m = x.shape[1]
    assert fn.shape == (m, m * x.shape[2]), fn.shape
    u, _, _ = _launch_mix(x, x.stride(1), x.shape[2], fn, scale, base, 1, eps, rms_eps,
                          is_head=True, m=m, block_k=block_k)  # fmt: skip
    return u


def _num_streams(n_mix: int) -> int:
    m = 1
    while (2 + m) * m < n_mix:
        m += 1
    assert (2 + m) * m == n_mix, n_mix
    return m


@triton.jit
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
    """Reference (and unfused slow path) of `hc_pre`, DSV4_ARCH.md §4.2 verbatim."""
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
    """Reference of `hc_head` (DSV4_ARCH.md §4.4)."""
    a = torch.sigmoid(_mixes_ref(x, fn, rms_eps) * scale.float()[0] + base.float()) + eps
    return (a.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)


def hc_post_ref(y, x, post, comb):
    """Reference of `hc_post` (DSV4_ARCH.md §4.3); x may be [T, D] (M equal streams)."""
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
