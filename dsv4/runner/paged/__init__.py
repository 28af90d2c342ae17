"""The paged forward: every step as one flat batch on the packed cache, through the kernels.

Reading path: `step_forward.py` (the `StepForward`: graphs or eager, speculation) ->
`step_metadata.py` (a step as device tensors, shared metadata) -> `geometry.py` (where each
layer's pages are) -> `forward.py` (the layer loop: the model's blocks, MoE routing) ->
`attention.py` (one layer) -> `compress.py`, `indexer.py`, `prefill.py` (workspaces),
`kv_rows.py` (cache row codecs). Decode graphs: `decode_graphs.py` over `graphs.py`. MTP:
`speculative.py` (verify, accept, propose) over `mtp_passes.py` (the MTP layer's passes).
Offloaded experts: `expert_pool.py` (`pool_experts`), `expert_rounds.py`, `pool_storage.py`.
"""

from dsv4.runner.paged.expert_pool import ExpertPool, PoolOptions, PoolStats, pool_experts
from dsv4.runner.paged.forward import PagedForward, PagedOutput
from dsv4.runner.paged.forward_state import PagedSwitches
from dsv4.runner.paged.step_forward import PagedOptions, PagedStepForward
from dsv4.runner.paged.step_metadata import MetadataSwitches

__all__ = [
    "ExpertPool",
    "MetadataSwitches",
    "PagedForward",
    "PagedOptions",
    "PagedOutput",
    "PagedStepForward",
    "PagedSwitches",
    "PoolOptions",
    "PoolStats",
    "pool_experts",
]
