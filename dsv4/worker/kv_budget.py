"""How many KV blocks a worker allocates: `cache.num_blocks`, a byte budget, or on a GPU what
keeps the worker inside `cache.memory_fraction` of the card (as vLLM's gpu_memory_utilization,
and as the start-up plan counts it), leaving the step workspaces allocated after the cache
their room."""

from __future__ import annotations

import torch

from dsv4.cache.layout import KVLayout
from dsv4.config import ServeConfig
from dsv4.errors import ConfigError

CPU_DEFAULT_KV_BUDGET_BYTES = 512 << 20
# left free beside the cache when the card is nearly full: libraries allocating outside torch's
# pool after start-up (cuBLAS / NCCL / FlashInfer workspaces, the context's own growth)
FREE_HEADROOM_BYTES = 512 << 20


def num_blocks_for(config: ServeConfig, layout: KVLayout, reserve_bytes: int = 0) -> int:
    """KV blocks: `cache.num_blocks`, else what `cache.memory_budget_bytes` holds, else on a
    GPU `kv_budget_bytes` of its free memory."""
    c = config.cache
    if c.num_blocks:
        return c.num_blocks
    budget = c.memory_budget_bytes
    if not budget:
        if config.model.device.startswith("cuda"):
            dev = torch.device(config.model.device)
            # the load's dead transients stay reserved in the allocator's cache: hand them
            # back, or the budget below counts them as held. A random 43-layer V4-Flash kept
            # 5.9 GiB so (3 fp32 [129280, 4096] draws of embed and head): 60.41 GiB allocated,
            # 66.3 reserved, over 90% of a 68.5 GiB budget, and the cache got 0 bytes on the
            # reference forward (the paged one empties the cache as it builds its expert pool)
            torch.cuda.empty_cache()
            free_bytes, card_bytes = torch.cuda.mem_get_info(dev)
            # the worker's share is of its device budget, else of the whole card: a share of
            # what was free once the weights were in gave a 43-layer offload worker at 0.94
            # 8.2 GiB of KV for one 1280-token request (98% of the H200 in use) that the
            # plan had given to resident experts' room, and gave workers sharing a card KV
            # by their start order
            within = int(config.model.device_memory_gib * (1 << 30)) or card_bytes
            budget = kv_budget_bytes(free_bytes, c.memory_fraction, reserve_bytes,
                                     within, torch.cuda.memory_reserved(dev))  # fmt: skip
        else:
            budget = CPU_DEFAULT_KV_BUDGET_BYTES
    num_blocks = layout.num_blocks_for_budget(budget)
    if num_blocks < layout.num_blocks_for_request(config.cache.block_size):
        raise ConfigError(
            "cache.memory_budget_bytes", budget, "too small for one request: raise it"
        )
    return num_blocks


def kv_budget_bytes(free_bytes: int, fraction: float, reserve_bytes: int,
                    within_bytes: int, held_bytes: int) -> int:  # fmt: skip
    """The KV cache's bytes on a GPU: `fraction` of the device (`within_bytes`: the card, or
    `model.device_memory_gib`) less what the worker holds already (`held_bytes`) and less
    `reserve_bytes`, the step workspaces the engine allocates after the cache (the plan's
    buffers; sized without them, the cache left a 43-layer offload worker's first 8K-token
    step 0.4 GiB for a 1 GiB scratch on an H100). Never more than the free memory less those
    workspaces and `FREE_HEADROOM_BYTES` (another process holds part of the card); never
    negative (one request then refuses)."""
    share = int(within_bytes * fraction) - held_bytes - reserve_bytes
    return max(min(share, free_bytes - reserve_bytes - FREE_HEADROOM_BYTES), 0)
