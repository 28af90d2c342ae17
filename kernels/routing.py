"""MoE routing for DeepSeek-V4 (docs/model.md#routing), fused into one launch per MoE layer.

Scored layers (noaux_tc): s = sqrt(softplus(g)) over the fp32 gate logits g [T, E]; the experts
are the top-k of s + bias (the correction bias is used for selection only); the weights are the
UNBIASED scores of the chosen experts, renormalised to sum to one and multiplied by the routed
scaling factor. Hash layers take the experts from `tid2eid[token_id]` and weight them the same
way. The gate GEMM itself stays outside.

`route` does score, bias, top-k, gather, renormalisation and scaling in one program per block of
tokens with all E experts of a row in registers; the top-k is k rounds of an arg-max (k <= 8 in
practice). Two variants, chosen by constexprs:
- generic: each round is a max, then a min over the indices holding the max (lowest index wins
  ties), then a masked sum to gather the unbiased score;
- DeepSeek-V4 fast path (E = 256 or 384, k = 6; #47463/#48660): the selection value is mapped to
  a monotone int32 key and packed with the (reversed) expert index into one int64, so each round
  is a single max reduction that yields value and index at once; the unbiased score is recomputed
  from the logit reloaded at that index (an L1 hit) instead of a second reduction.

`route_ref` / `hash_route_ref` are the plain torch sequences (softplus, sqrt, add, topk, gather,
sum, div, mul: one kernel each), which are also the slow path the benchmark compares against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.registry import register_op
from kernels.specialize import sizes_vary

RENORM_EPS = 1e-20  # as in transformers' DeepseekV4TopKRouter


@triton.jit
def _sqrt_softplus(x):
    # softplus(x) = max(x, 0) + log1p(exp(-|x|)), with torch's threshold (x > 20 -> x).
    z = tl.exp(-tl.abs(x))
    log1p_z = tl.where(z < 1e-4, z - 0.5 * z * z, tl.log(1.0 + z))
    sp = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p_z)
    return tl.sqrt(sp)


@triton.jit(**sizes_vary("T"))
def _route_kernel(
    # Pointers: logits [T, E] fp32, bias [E] fp32; outputs weights [T, K] fp32, ids [T, K] int32
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    # Sizes, strides (elements), scalars
    T,
    E,
    stride_lt,
    routed_scaling,
    # Meta-parameters
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,  # next power of two >= E
    BLOCK_K: tl.constexpr,  # next power of two >= K
    PACKED: tl.constexpr,  # fast path: one int64 max per round (value key | reversed index)
    RENORMALIZE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    kcols = tl.arange(0, BLOCK_K)
    row_ok = rows < T
    mask = row_ok[:, None] & (cols < E)[None, :]
    row_off = rows.to(tl.int64) * stride_lt

    x = tl.load(logits_ptr + row_off[:, None] + cols[None, :], mask=mask, other=0.0)
    s = _sqrt_softplus(x.to(tl.float32))  # [BLOCK_T, BLOCK_E] unbiased scores
    bias = tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)
    sel = tl.where(mask, s + bias[None, :], float("-inf"))  # selection values

    w_tile = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    id_tile = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    if PACKED:
        bits = sel.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # monotone in the float value
        rev = (BLOCK_E - 1 - cols).to(tl.int64)  # larger low bits = lower index wins ties
        packed = (key.to(tl.int64) << 32) | rev[None, :]
        taken = tl.full([BLOCK_T, BLOCK_E], -9223372036854775807 - 1, tl.int64)
        for j in tl.static_range(K):
            best = tl.max(packed, axis=1)
            idx = (BLOCK_E - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
            packed = tl.where(packed == best[:, None], taken, packed)
            xg = tl.load(logits_ptr + row_off + idx, mask=row_ok, other=0.0).to(tl.float32)
            w_tile = tl.where(kcols[None, :] == j, _sqrt_softplus(xg)[:, None], w_tile)
            id_tile = tl.where(kcols[None, :] == j, idx[:, None], id_tile)
    else:
        for j in tl.static_range(K):
            best = tl.max(sel, axis=1)
            idx = tl.min(tl.where(sel == best[:, None], cols[None, :], BLOCK_E), axis=1)
            hit = cols[None, :] == idx[:, None]
            w = tl.sum(tl.where(hit, s, 0.0), axis=1)
            sel = tl.where(hit, float("-inf"), sel)
            w_tile = tl.where(kcols[None, :] == j, w[:, None], w_tile)
            id_tile = tl.where(kcols[None, :] == j, idx[:, None], id_tile)

    if RENORMALIZE:
        w_tile = w_tile / (tl.sum(w_tile, axis=1)[:, None] + 1e-20)
    out_mask = row_ok[:, None] & (kcols < K)[None, :]
    out_off = rows.to(tl.int64)[:, None] * K + kcols[None, :]
    tl.store(weights_ptr + out_off, w_tile * routed_scaling, mask=out_mask)
    tl.store(ids_ptr + out_off, id_tile, mask=out_mask)


@triton.jit(**sizes_vary("T"))
def _hash_route_kernel(
    # Pointers: logits [T, E] fp32, token_ids [T], tid2eid [V, K]; outputs weights, ids [T, K]
    logits_ptr,
    token_ids_ptr,
    tid2eid_ptr,
    weights_ptr,
    ids_ptr,
    # Sizes, strides (elements), scalars
    T,
    stride_lt,
    stride_hv,
    routed_scaling,
    # Meta-parameters
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    kcols = tl.arange(0, BLOCK_K)
    row_ok = rows < T
    mask = row_ok[:, None] & (kcols < K)[None, :]
    tok = tl.load(token_ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    eid = tl.load(tid2eid_ptr + tok[:, None] * stride_hv + kcols[None, :], mask=mask, other=0)
    eid = eid.to(tl.int32)
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_lt + eid, mask=mask, other=0.0)
    w = tl.where(mask, _sqrt_softplus(x.to(tl.float32)), 0.0)
    if RENORMALIZE:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    out_off = rows.to(tl.int64)[:, None] * K + kcols[None, :]
    tl.store(weights_ptr + out_off, w * routed_scaling, mask=mask)
    tl.store(ids_ptr + out_off, eid, mask=mask)


def _block_t(num_tokens: int, row_elems: int, on_gpu: bool) -> int:
    if on_gpu:  # about 2K elements of the [BLOCK_T, BLOCK_E] tile per program
        return max(1, min(triton.next_power_of_2(max(num_tokens, 1)), 2048 // row_elems, 16))
    return min(triton.next_power_of_2(max(num_tokens, 1)), 64)  # interpreter: few programs


def is_fast_route_shape(num_experts: int, k: int) -> bool:
    """The DeepSeek-V4 Flash/Pro shapes served by the packed fast path."""
    return num_experts in (256, 384) and k == 6


def route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    k: int,
    routed_scaling: float,
    renormalize: bool = True,
    *,
    fast: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scored routing in one launch.

    logits [T, E] fp32 (gate GEMM output), bias [E] fp32 (selection only), 1 <= k <= E.
    Returns weights [T, k] fp32 (unbiased scores, renormalised if asked, times routed_scaling)
    and expert_ids [T, k] int32 (in selection order). `fast` forces the packed path on/off
    (default: on for the DeepSeek-V4 shapes).
    """
    assert logits.dim() == 2 and logits.dtype == torch.float32, (logits.shape, logits.dtype)
    num_tokens, num_experts = logits.shape
    assert bias.shape == (num_experts,) and 1 <= k <= num_experts, (bias.shape, k)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    weights = torch.empty(num_tokens, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    block_t = _block_t(num_tokens, block_e, logits.is_cuda)
    packed = is_fast_route_shape(num_experts, k) if fast is None else fast
    _route_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits, bias.float().contiguous(), weights, ids,
        num_tokens, num_experts, logits.stride(0), float(routed_scaling),
        K=k, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(k),
        PACKED=packed, RENORMALIZE=renormalize, num_warps=4,
    )  # fmt: skip
    return weights, ids


def hash_route(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    tid2eid: torch.Tensor,
    routed_scaling: float,
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing: experts = tid2eid[token_ids]; weights as in `route`.

    logits [T, E] fp32, token_ids [T] int32/int64, tid2eid [V, k] int32/int64 (keep it in the
    dtype it is stored in: no per-call conversion of the [V, k] table). Returns weights [T, k]
    fp32 and expert_ids [T, k] int32.
    """
    assert logits.dim() == 2 and logits.dtype == torch.float32, (logits.shape, logits.dtype)
    assert token_ids.shape == (logits.shape[0],) and tid2eid.dim() == 2
    num_tokens, k = logits.shape[0], tid2eid.shape[1]
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    tid2eid = tid2eid if tid2eid.stride(1) == 1 else tid2eid.contiguous()
    weights = torch.empty(num_tokens, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    block_k = triton.next_power_of_2(k)
    block_t = min(triton.next_power_of_2(num_tokens), 64)
    _hash_route_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits, token_ids.contiguous(), tid2eid, weights, ids,
        num_tokens, logits.stride(0), tid2eid.stride(0), float(routed_scaling),
        K=k, BLOCK_T=block_t, BLOCK_K=block_k, RENORMALIZE=renormalize, num_warps=4,
    )  # fmt: skip
    return weights, ids


def _finish_weights(w: torch.Tensor, routed_scaling: float, renormalize: bool) -> torch.Tensor:
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + RENORM_EPS)
    return w * routed_scaling


def route_ref(
    logits: torch.Tensor,
    bias: torch.Tensor,
    k: int,
    routed_scaling: float,
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (and unfused slow path) of `route`: same shapes and dtypes."""
    scores = F.softplus(logits.float()).sqrt()  # [T, E]
    ids = torch.topk(scores + bias.float(), k, dim=-1).indices  # [T, k] int64
    weights = _finish_weights(scores.gather(1, ids), routed_scaling, renormalize)
    return weights, ids.to(torch.int32)


def hash_route_ref(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    tid2eid: torch.Tensor,
    routed_scaling: float,
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (and unfused slow path) of `hash_route`: same shapes and dtypes."""
    ids = tid2eid[token_ids.long()].long()  # [T, k]
    scores = F.softplus(logits.float()).sqrt()
    weights = _finish_weights(scores.gather(1, ids), routed_scaling, renormalize)
    return weights, ids.to(torch.int32)


register_op("route", route, route_ref, family="routing")
register_op("hash_route", hash_route, hash_route_ref, family="routing")
