"""Tensor and expert parallelism inside one model replica (see README.md in this folder)."""

from dsv4.parallel.attention import TensorParallelAttention
from dsv4.parallel.group import (
    ParallelGroup,
    close_group,
    default_backend,
    init_cpu_group,
    launch_env,
)
from dsv4.parallel.moe import ExpertParallelMoE, local_expert_ids
from dsv4.parallel.shard import check_shardable, shard_model

__all__ = [
    "ExpertParallelMoE",
    "ParallelGroup",
    "TensorParallelAttention",
    "check_shardable",
    "close_group",
    "default_backend",
    "init_cpu_group",
    "launch_env",
    "local_expert_ids",
    "shard_model",
]
