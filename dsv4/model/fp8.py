"""FP8 linears held as the checkpoint stores them (`features.linear_weights=checkpoint`).

A DeepSeek-V4 checkpoint stores the attention, shared-expert and MTP projections
(`inventory.FP8_LINEAR_SUFFIXES`) as e4m3 weights with one scale per 128x128 block (UE8M0, or
fp32 in -Base checkpoints; docs/model.md#fp8-linears). By default the loader dequantises them to
the model dtype. With the switch, `quantized_linears_` swaps those `nn.Linear` modules for
`FP8Linear` before the load and the loader copies weight and scale as stored (about half the bf16
bytes). Every call dequantises: the torch reference the whole weight, then `F.linear` (the very
values a dequantising load holds, so the outputs are the same; `dsv4.ops.fp8`); the Triton
kernel (kernels/fp8_linear.py, when the model's hot ops say so) tile by tile in registers.

The one use of such a weight other than `linear(x)`, attn.wo_a's grouped output projection,
goes through `grouped_linear` (either format). Tensor parallelism (it slices weights) refuses
FP8 linears with a ConfigError; the fused shared expert is refused at config validation.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.errors import ConfigError
from dsv4.model.hot_ops import REFERENCE_OPS, HotOps
from dsv4.model.inventory import FP8_LINEAR_SUFFIXES
from dsv4.ops.fp8 import FP8_BLOCK

LINEAR_WEIGHTS = ("bf16", "checkpoint")
ACTIVATIONS = ("bf16", "fp8")  # exact (x as is), or W8A8 (x quantised per 1x128 group)


class FP8Linear(nn.Module):
    """A bias-free linear held as stored: `weight` e4m3 [out, in] and `scale` [ceil(out/128),
    ceil(in/128)], so state_dict keys read `<name>.weight` / `<name>.scale` as in the checkpoint.
    Both are frozen parameters (they count in `parameters()`; `cast_` leaves them alone)."""

    def __init__(self, in_features: int, out_features: int,
                 scale_dtype: torch.dtype = torch.float8_e8m0fnu, device=None,
                 activations: str = "bf16") -> None:  # fmt: skip
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ConfigError("features.linear_weights", activations, "activations bf16 or fp8")
        self.in_features, self.out_features = in_features, out_features
        self.activations = activations  # "fp8": W8A8 (its own switch; changes the numerics)
        blocks = (-(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK))
        weight = torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)  # [N, K]
        scale = torch.empty(blocks, dtype=scale_dtype, device=device)
        self.scale = nn.Parameter(scale, requires_grad=False)  # [ceil(N/128), ceil(K/128)]
        self.ops: HotOps = REFERENCE_OPS  # fp8_(grouped_)linear (DeepseekV4.use_hot_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations == "fp8":
            return self.ops.fp8_linear(x, self.weight, self.scale, activations="fp8")
        return self.ops.fp8_linear(x, self.weight, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"scale={self.scale.dtype}, activations={self.activations}"  # fmt: skip


def grouped_linear(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x [B, S, G, K] through `linear`'s weight [G*N, K] split into G row groups -> [B, S, G, N]
    (attn.wo_a), whether it is a dense `nn.Linear` or an `FP8Linear`."""
    if isinstance(linear, FP8Linear) and linear.activations == "fp8":
        return linear.ops.fp8_grouped_linear(x, linear.weight, linear.scale, activations="fp8")
    if isinstance(linear, FP8Linear):
        return linear.ops.fp8_grouped_linear(x, linear.weight, linear.scale)
    w = linear.weight.view(x.shape[-2], -1, x.shape[-1])  # [G, N, K]
    return torch.einsum("bsgk,gok->bsgo", x, w)


def set_linear_activations_(model: nn.Module, activations: str) -> int:
    """Serve every `FP8Linear` of `model` with `activations` ("bf16": exact; "fp8": W8A8,
    `features.linear_activations`). Returns how many it set."""
    if activations not in ACTIVATIONS:
        raise ConfigError("features.linear_activations", activations, "use bf16 or fp8")
    linears = [m for m in model.modules() if isinstance(m, FP8Linear)]
    for linear in linears:
        linear.activations = activations
    return len(linears)


def served_linear_format(cfg, linear_weights: str) -> str:
    """The format the FP8 linears are held in: "bf16" (the model dtype: `linear_weights` "bf16",
    or a checkpoint of bf16 linears) or "fp8" (`linear_weights` "checkpoint" on an FP8
    checkpoint, `features.linear_weights`)."""
    if linear_weights not in LINEAR_WEIGHTS:
        raise ConfigError("features.linear_weights", linear_weights, "use bf16 or checkpoint")
    return "fp8" if linear_weights == "checkpoint" and cfg.linear_dtype == "fp8" else "bf16"


def quantized_linears_(model: nn.Module, device: torch.device | str,
                       scale_dtype: torch.dtype | None = None) -> list[str]:  # fmt: skip
    """Replace every `nn.Linear` a checkpoint stores as FP8 (`FP8_LINEAR_SUFFIXES`: attention,
    indexer q, shared expert, MTP projections) by an empty `FP8Linear` on `device`, for a loader
    (or `random_model`) to fill, so no dense copy ever exists. `scale_dtype`: the checkpoint's
    (UE8M0 default, or fp32). Call it on the model before its weights are allocated (meta).
    Returns the swapped module names."""
    cfg = model.cfg
    if cfg.fp8_block_size != FP8_BLOCK:
        raise ConfigError("features.linear_weights", "checkpoint",
                          f"FP8 linears are served with {FP8_BLOCK}x{FP8_BLOCK} scale blocks "
                          f"(this checkpoint: {cfg.fp8_block_size}): serve them as bf16")  # fmt: skip
    swapped = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name.endswith(FP8_LINEAR_SUFFIXES):
            parent, _, attr = name.rpartition(".")
            fp8 = FP8Linear(module.in_features, module.out_features,
                            scale_dtype or torch.float8_e8m0fnu, device)  # fmt: skip
            fp8.ops = getattr(model, "ops", REFERENCE_OPS)  # the model's, if already given
            setattr(model.get_submodule(parent), attr, fp8)
            swapped.append(name)
    return swapped
