"""W4A8 routed experts (`features.moe_activations` fp8): MXFP4 weights met by e4m3 activations
on the FP8 tensor cores. The reference of kernels/moe_w4a8.py, in torch only.

Why: Hopper's FP8 MMA runs at twice the bf16 rate, and an e2m1 code becomes an e4m3 byte as
cheaply as a bf16 one, so from ~1024 tokens (where the experts are MMA-bound, not weight-bound)
the same codes cost about half the tensor-core time. It changes the numerics (x and the SwiGLU
output h are rounded to e4m3, ~2^-4 relative per element), so it is its own switch, measured
against the exact path (FlashInfer's SM90 "humming" MoE and SGLang's W4A8 backend do the same).

Weights: an e2m1 code times its group's UE8M0 scale 2^(s-127) (one per 32 columns) is fed as
    e4m3(e2m1 * 2^(s - r)) * 2^(r - 127),   r = max of s over the 128-column block (4 groups)
The e4m3 factor is exact while s >= r - 8 (e4m3 reaches 2^-9; e2m1's smallest non-zero value is
0.5), i.e. for every group within 8 binades of its block's largest, and rounds to nearest even
below that; 2^(r - 127) multiplies the block's fp32 partial sum after the MMA (DeepGEMM's
per-K-block promotion), together with the activation group's scale.
Activations: x and h quantised per 1x128 group as the W8A8 linears are (`dsv4.ops.fp8.
quantize_activations`: amax / 448 in fp32, round to nearest even).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4.ops.fp8 import w8a8_activations
from dsv4.ops.moe import gated_silu
from dsv4.ops.quant import MXFP4_BLOCK, e2m1_decode, mxfp4_codes

W4A8_BLOCK = 128  # columns per reference exponent r (= the activation group, the kernel's K step)


def w4a8_weight(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Stored MXFP4 codes [rows, cols/2] int8 (low nibble = even column) x UE8M0 scales
    [rows, cols/32] -> fp32 [rows, cols]: the values the W4A8 MMA multiplies (module doc)."""
    rows, cols = packed.shape[0], packed.shape[1] * 2
    assert cols % W4A8_BLOCK == 0, cols
    values = e2m1_decode(mxfp4_codes(packed)).view(rows, cols // MXFP4_BLOCK, MXFP4_BLOCK)
    s = scale.view(torch.uint8).int()  # [rows, G]
    r = s.view(rows, -1, W4A8_BLOCK // MXFP4_BLOCK).amax(-1)  # [rows, cols/128]
    rel = (s - r.repeat_interleave(W4A8_BLOCK // MXFP4_BLOCK, -1)).clamp(min=-126)
    factor = torch.ldexp(values, rel[..., None]).to(torch.float8_e4m3fn).float()
    block = factor.view(rows, -1, W4A8_BLOCK)
    return torch.ldexp(block, (r - 127)[..., None].float()).view(rows, cols)


def w4a8_swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                limit: float | None) -> torch.Tensor:  # fmt: skip
    """`dsv4.ops.moe.swiglu` with W4A8 numerics: x [n, D] bf16, w1/w3 [I, D] and w2 [D, I]
    `w4a8_weight`s -> [n, D] bf16. x and h quantised per 1x128 group; the gate, up and output
    products in fp32, rounded to bf16 as the exact path rounds them."""
    xq = w8a8_activations(x)  # [n, D] fp32: e4m3 codes x group scales
    gate = F.linear(xq, w1).to(torch.bfloat16)
    up = F.linear(xq, w3).to(torch.bfloat16)
    h = gated_silu(gate, up, limit).to(torch.bfloat16)
    return F.linear(w8a8_activations(h), w2).to(torch.bfloat16)
