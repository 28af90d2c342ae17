"""`shard_model`: turn a constructed (and loaded) DeepseekV4 into this rank's shard, in place.

Applied after construction, gpt-fast style: every block's (and the MTP layer's) `attn` becomes a
`TensorParallelAttention` and its `ffn` an `ExpertParallelMoE`; embedding, mHC, norms and the
head stay replicated. Each sharded sublayer ends in one fp32 all-reduce of [B, S, D], so a block
costs two all-reduces and the model 2 * (num_hidden_layers + 1 with MTP) per forward.
"""

from __future__ import annotations

from dsv4.config.model import ModelConfig
from dsv4.errors import ConfigError
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.model.fp8 import FP8Linear
from dsv4.parallel.attention import TensorParallelAttention
from dsv4.parallel.group import ParallelGroup
from dsv4.parallel.moe import ExpertParallelMoE


def check_shardable(cfg: ModelConfig, world_size: int, *, expert_parallel: bool = True) -> None:
    """Raise ConfigError (field, value, fix) when `cfg` cannot be split over `world_size`."""
    if cfg.o_groups % world_size:
        raise ConfigError(
            "o_groups", cfg.o_groups, f"must be divisible by the world size {world_size}: "
            "each rank computes whole output groups; use a world size that divides it"
        )  # fmt: skip
    shared_inter = cfg.moe_intermediate_size * cfg.n_shared_experts
    if shared_inter % world_size:
        raise ConfigError(
            "moe_intermediate_size", cfg.moe_intermediate_size,
            f"the shared expert's width {shared_inter} must be divisible by the world size "
            f"{world_size}; use a world size that divides it",
        )  # fmt: skip
    if not expert_parallel and cfg.moe_intermediate_size % world_size:
        raise ConfigError(
            "moe_intermediate_size", cfg.moe_intermediate_size,
            f"tensor-parallel experts split it over {world_size} ranks: use a world size that "
            "divides it, or expert parallelism",
        )  # fmt: skip
    if expert_parallel and cfg.n_routed_experts < world_size:
        raise ConfigError(
            "n_routed_experts", cfg.n_routed_experts,
            f"fewer experts than ranks ({world_size}): use a world size <= n_routed_experts",
        )  # fmt: skip


def shard_model(
    model: DeepseekV4, group: ParallelGroup, *, expert_parallel: bool = True
) -> DeepseekV4:
    """Rewrite `model` in place into rank `group.rank`'s shard and return it. Every rank must
    shard an identical model (same weights) with the same world size; the sharded forward is a
    collective (all ranks run it on the same inputs). Freed: the other ranks' heads and experts
    (with `expert_parallel` False: the other ranks' slices of every expert).
    Raises ConfigError, changing nothing, for a bad world size or an offloaded/sharded model."""
    check_shardable(model.cfg, group.world_size, expert_parallel=expert_parallel)
    blocks = (*model.layers, *model.mtp)
    # Refuse before rewriting anything, so a failed call leaves the model as it was.
    if any(isinstance(block.attn, TensorParallelAttention) for block in blocks):
        raise ConfigError("model", "already sharded", "shard a freshly built model once")
    if any(isinstance(m, FP8Linear) for m in model.modules()):
        raise ConfigError("features.linear_weights", "checkpoint", "tensor parallelism slices "
                          "dense linears: load the linears as bf16")  # fmt: skip
    if any(block.ffn.expert_store is not None for block in blocks):
        raise ConfigError(
            "expert offload", "on", "cannot be combined with expert parallelism: turn one off"
        )
    for block in blocks:
        block.attn = TensorParallelAttention(block.attn, group)
        block.ffn = ExpertParallelMoE(
            block.ffn, block.layer_id, group, expert_parallel=expert_parallel
        )
    left = [name for name, t in model.state_dict().items() if t.is_meta]
    assert not left, f"sharding left unallocated tensors: {left[:4]}"
    return model
