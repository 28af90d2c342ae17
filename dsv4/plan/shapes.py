"""Full-depth V4-Flash and V4-Pro configs for planning (docs/model.md#configurations), as served:
FP8 linears with 128x128 UE8M0 block scales, MXFP4 routed experts.

`dsv4.config.model.flash_config` is the few-layer benchmark slice; these are the real models.
"""

from __future__ import annotations

from dsv4.config.model import ModelConfig
from dsv4.errors import ConfigError

SHAPES = ("flash", "pro")


def _alternating(num_layers: int, first_two: int) -> tuple[int, ...]:
    # Layers 0-1 are special; layers 2.. alternate 4, 128, 4, ... (the last one is a 4).
    rest = (4 if i % 2 == 0 else 128 for i in range(num_layers - 2))
    return (first_two, first_two, *rest)


def full_flash_config() -> ModelConfig:
    """V4-Flash: 43 layers (2 SWA, 21 C4, 20 C128), 256 experts of I = 2048, D = 4096."""
    return ModelConfig(
        num_hidden_layers=43,
        compress_ratios=_alternating(43, 0),
        num_hash_layers=3,
        linear_dtype="fp8",
        expert_dtype="fp4",
    )


def full_pro_config() -> ModelConfig:
    """V4-Pro: 61 layers (30 C4, 31 C128), 384 experts of I = 3072, D = 7168."""
    return ModelConfig(
        hidden_size=7168,
        num_hidden_layers=61,
        compress_ratios=_alternating(61, 128),
        num_attention_heads=128,
        q_lora_rank=1536,
        o_groups=16,
        o_lora_rank=1024,
        index_topk=1024,
        n_routed_experts=384,
        moe_intermediate_size=3072,
        routed_scaling_factor=2.5,
        num_hash_layers=3,
        linear_dtype="fp8",
        expert_dtype="fp4",
    )


def shape_config(shape: str) -> ModelConfig:
    if shape == "flash":
        return full_flash_config()
    if shape == "pro":
        return full_pro_config()
    raise ConfigError("shape", shape, f"choose one of {SHAPES}")
