"""W8A8 FP8 linears through torch's block-scaled FP8 GEMM (cuBLASLt on sm_90), issue 21.

DeepSeek's own scheme: x quantised to e4m3 per 1x128 group (one fp32 scale per row and 128
columns, the same quantisation as kernels/fp8_w8a8.py: amax / 448), the weight as stored (e4m3
[N, K], one scale per 128x128 block), and cuBLASLt's FP8 GEMM applying both scales per K block
(CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F on A, BLK128x128_32F on B; fp32 accumulation, bf16
or fp32 output). It is the W8A8 switch's path (`linear_activations=fp8`) at prefill row counts,
where the Triton W8A8 GEMM ran at 0.5-0.83x of bf16 on an H100; never an exact path.

The API, whichever this torch has (the card's 2.11.0+cu130 has both; `available_apis`):
- "scaled_mm": `torch.nn.functional.scaled_mm(a, b, scale_a, ScalingType.BlockWise1x128,
  scale_b, ScalingType.BlockWise128x128, output_dtype=...)` (torch >= 2.10), first;
- "_scaled_mm": `torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=...)`, which infers the
  recipe from the scales' shapes and strides (blockwise since 2.8), the fallback.
The first that runs is kept; where neither exists, or both refuse (not sm_90, cuBLASLt < 12.9),
`BlockScaledMMUnavailable` says why. Layout rules (ScaledBlas.cpp, torch/_meta_registrations.py):
- a = x_e4m3 [M, K] row-major, b = W^T [K, N] column-major (the stored W [N, K] `.t()`);
  K and N multiples of 16, and of 128 here: `scaled_mm` checks scale shapes with K // 128 and
  N // 128, so the weight's scale blocks must tile W exactly (every V4 linear's do);
- scale_a fp32 [M, K/128], outer-dim-major: stride (1, M), i.e. a contiguous [K/128, M]
  viewed `.t()` (`_act_quant_t_kernel` writes it so: no transpose launch);
- scale_b fp32 (UE8M0 scales are converted once) [L, N/128] with stride (1, L): the stored
  [N/128, K/128] scale, contiguous, `.t()`; "scaled_mm" wants L = K/128 rounded up to a
  multiple of 4 (zero-padded columns), "_scaled_mm" L = K/128 (the same when K % 512 == 0);
- no fast accumulation (refused with block scales); a bias is possible but unused.
M (rows) is padded to ROW_ALIGN with zero rows, so scale_a's columns start 16-byte aligned.
The weight's scale operand is laid out once per scale tensor (`weight_scale_operand`, cached
by identity and version), not per call; grouped linears (wo_a, G groups of N rows) run one
GEMM a group on views (N a multiple of 128: each group starts on a scale block), then stack.
No host sync, no data-dependent allocation: CUDA-graph capturable once warmed (the first call
lays out the weight scale and picks the API).
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dsv4.errors import Dsv4Error
from kernels.fp8_w8a8 import _quantize_groups, _to_e4m3
from kernels.specialize import sizes_vary

GROUP = 128  # activation columns per scale = the weight's scale block
# rows padded to this: scale_a's K-block columns (stride M fp32) start 16-byte aligned for the
# cuBLASLt scale loads, and M is a multiple of the 16-row MMA tile; zero rows cost no time at
# the row counts this path serves (64+)
ROW_ALIGN = 16
APIS = ("scaled_mm", "_scaled_mm")  # preference order
_API_IN_USE: list[str] = []  # the first API that ran, kept for every later call
# (id(scale), api) -> (weakref to scale, scale._version, the laid-out fp32 operand)
_SCALE_CACHE: dict[tuple[int, str], tuple[weakref.ref, int, torch.Tensor]] = {}


class BlockScaledMMUnavailable(Dsv4Error):
    """torch here has no block-scaled FP8 GEMM (1x128 activations x 128x128 weights), or the
    device refuses it (cuBLASLt's block scales need sm_90 and CUDA >= 12.9)."""

    grpc_code = "FAILED_PRECONDITION"


@functools.cache  # asked on every W8A8 call by the dispatch
def available_apis() -> tuple[str, ...]:
    """The block-scaled GEMM entry points this torch has, in preference order."""
    found = []
    recipes = getattr(F, "ScalingType", None)
    if hasattr(F, "scaled_mm") and hasattr(recipes, "BlockWise128x128"):
        found.append("scaled_mm")
    if hasattr(torch, "_scaled_mm"):
        found.append("_scaled_mm")
    return tuple(found)


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def supported(x: torch.Tensor, n: int, k: int) -> bool:
    """Whether the default dispatch may take this path: a CUDA sm_90 input in bf16 / fp32,
    N (a group's rows) and K multiples of 128, and a block-scaled GEMM in this torch."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float32):
        return False
    if n % GROUP or k % GROUP or not available_apis():
        return False
    return _is_sm90(x.device.index if x.device.index is not None else torch.cuda.current_device())


@triton.jit(**sizes_vary("T", "T_pad"))
def _act_quant_t_kernel(x_ptr, q_ptr, s_ptr, T, T_pad, K, stride_xt, stride_xg, stride_qt,
                        stride_qg, stride_sg, stride_sk, ROUND: tl.constexpr,
                        BLOCK_T: tl.constexpr):  # fmt: skip
    """x [T, G, K] -> q [T_pad, G, K] e4m3 and s [G, K/128, T_pad] fp32 (s[g, j, t]: row t's
    scale of columns [128j, 128j + 128) in group g, cuBLASLt's outer-dim-major 1x128 layout);
    rows T..T_pad are zeros (scale 1e-4 / 448). Grid (T_pad / BLOCK_T, K / 128, G)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j, g = tl.program_id(1), tl.program_id(2)
    kk = j * 128 + tl.arange(0, 128)
    k_ok = (kk < K)[None, :]
    t64 = t.to(tl.int64)
    x = tl.load(x_ptr + t64[:, None] * stride_xt + g * stride_xg + kk[None, :],
                mask=(t < T)[:, None] & k_ok, other=0.0)  # fmt: skip
    q, s = _quantize_groups(x.to(tl.float32))  # the Triton W8A8 quantiser's math, bit for bit
    keep = t < T_pad
    tl.store(q_ptr + t64[:, None] * stride_qt + g * stride_qg + kk[None, :], _to_e4m3(q, ROUND),
             mask=keep[:, None] & k_ok)  # fmt: skip
    tl.store(s_ptr + g * stride_sg + j * stride_sk + t64, s, mask=keep)


def quantize_activations_t(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, G, K] (K contiguous, K % 128 == 0) -> (q [T_pad, G, K] e4m3, s [G, K/128, T_pad]
    fp32), T_pad = T rounded up to ROW_ALIGN; group g's GEMM operands are q[:, g] ([T_pad, K],
    row stride G*K) and s[g].t() ([T_pad, K/128], strides (1, T_pad))."""
    rows, groups, k = x.shape
    assert k % GROUP == 0 and x.stride(2) == 1, (x.shape, x.stride())
    padded = triton.cdiv(max(rows, 1), ROW_ALIGN) * ROW_ALIGN
    q = torch.empty(padded, groups, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(groups, k // GROUP, padded, dtype=torch.float32, device=x.device)
    block_t = 16
    _act_quant_t_kernel[(triton.cdiv(padded, block_t), k // GROUP, groups)](
        x, q, s, rows, padded, k, x.stride(0), x.stride(1), q.stride(0), q.stride(1),
        s.stride(0), s.stride(1), ROUND=not x.is_cuda, BLOCK_T=block_t, num_warps=4,
    )  # fmt: skip
    return q, s


def weight_scale_operand(scale: torch.Tensor, api: str) -> torch.Tensor:
    """The weight's [ceil(N/128), K/128] block scales (UE8M0 or fp32) as `api`'s scale_b: fp32
    [L, N/128] with strides (1, L), the transposed view of a contiguous [N/128, L] (L = K/128,
    rounded up to a multiple of 4 with zero columns for "scaled_mm"). Laid out once per scale
    tensor and kept while that tensor lives and is not written in place."""
    key = (id(scale), api)
    hit = _SCALE_CACHE.get(key)
    if hit is not None and hit[0]() is scale and hit[1] == scale._version:
        return hit[2]
    nb, kb = scale.shape
    width = triton.cdiv(kb, 4) * 4 if api == "scaled_mm" else kb
    laid = torch.zeros(nb, width, dtype=torch.float32, device=scale.device)
    laid[:, :kb] = scale.float()  # UE8M0 -> fp32 is exact (a power of two)
    operand = laid.t()
    _SCALE_CACHE[key] = (weakref.ref(scale, lambda _, key=key: _SCALE_CACHE.pop(key, None)),
                         scale._version, operand)  # fmt: skip
    return operand


def gemm_operands(q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale_b: torch.Tensor,
                  g: int) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Group g's (a [T_pad, K], b [K, N], scale_a [T_pad, K/128], scale_b [L, N/128]) from
    `quantize_activations_t`'s q, s, the weight [G*N, K] and its laid-out `scale_b`."""
    groups = q.shape[1]
    n = weight.shape[0] // groups
    nb = n // GROUP
    return q[:, g], weight[g * n : (g + 1) * n].t(), s[g].t(), scale_b[:, g * nb : (g + 1) * nb]


def _call(api: str, a, b, scale_a, scale_b, out_dtype: torch.dtype) -> torch.Tensor:
    if api == "scaled_mm":
        recipe = F.ScalingType
        return F.scaled_mm(a, b, scale_a, recipe.BlockWise1x128, scale_b, recipe.BlockWise128x128,
                           output_dtype=out_dtype)  # fmt: skip
    return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype)


def _run(api: str, q, s, weight, scale, out_dtype) -> torch.Tensor:
    """[T_pad, G, N]: one block-scaled GEMM a group."""
    scale_b = weight_scale_operand(scale, api)
    ops = [gemm_operands(q, s, weight, scale_b, g) for g in range(q.shape[1])]
    ys = [_call(api, *o, out_dtype) for o in ops]
    return ys[0].unsqueeze(1) if len(ys) == 1 else torch.stack(ys, dim=1)


def w8a8_cublas(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, G, K] (bf16 / fp32, K contiguous) through W = weight [G*N, K] e4m3 x scale
    [G*N/128, K/128], x quantised per 1x128 group -> y [T, G, N] in x's dtype."""
    rows, groups, k = x.shape
    n = weight.shape[0] // groups
    if n % GROUP or k % GROUP:
        raise BlockScaledMMUnavailable(
            f"block-scaled FP8 GEMM needs N and K multiples of {GROUP} (scale blocks that tile "
            f"the weight), got N={n} (per group), K={k}")  # fmt: skip
    assert weight.dtype == torch.float8_e4m3fn and weight.shape == (groups * n, k)
    assert scale.shape == (groups * n // GROUP, k // GROUP), scale.shape
    apis = list(_API_IN_USE) or list(available_apis())
    if not apis:
        raise BlockScaledMMUnavailable(
            f"torch {torch.__version__} has neither torch.nn.functional.scaled_mm nor "
            "torch._scaled_mm: no block-scaled FP8 GEMM (torch >= 2.8 with CUDA >= 12.9)")  # fmt: skip
    if rows == 0:
        return x.new_empty(0, groups, n)
    q, s = quantize_activations_t(x)
    errors = []
    for api in apis:
        try:
            y = _run(api, q, s, weight, scale, x.dtype)
        except (RuntimeError, ValueError, NotImplementedError, TypeError) as exc:
            errors.append(f"{api}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        if not _API_IN_USE:
            _API_IN_USE.append(api)
        return y[:rows]
    raise BlockScaledMMUnavailable(
        "no block-scaled FP8 GEMM ran (cuBLASLt's 1x128 x 128x128 scaling needs sm_90 and "
        f"CUDA >= 12.9; torch {torch.__version__}): " + " | ".join(errors))  # fmt: skip
