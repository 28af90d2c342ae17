"""Memory plan arithmetic: will this model, cache and step fit these GPUs (and host)?

Reading path: `shapes` (full Flash/Pro configs) -> `weights` (exact bytes per tensor kind and
format, sharded by TP/EP) -> `budget` (KV from `KVLayout`, workspaces, CUDA graphs, MTP) ->
`planner` (`plan_memory`, `check_fits`) -> `verdict` (fits / offload K experts / no, and why).
Pure Python: imports no torch, so `dsv4 plan` runs before anything is loaded.
"""

from dsv4.plan.planner import MemoryPlan, PlanDoesNotFit, PlanRequest, check_fits, plan_memory
from dsv4.plan.shapes import full_flash_config, full_pro_config, shape_config
from dsv4.plan.verdict import DOES_NOT_FIT, FITS, FITS_WITH_OFFLOAD, FITS_WITH_OFFLOAD_OVER_SLO
from dsv4.plan.weights import WeightFormats, expert_bytes

__all__ = [
    "DOES_NOT_FIT",
    "FITS",
    "FITS_WITH_OFFLOAD",
    "FITS_WITH_OFFLOAD_OVER_SLO",
    "MemoryPlan",
    "PlanDoesNotFit",
    "PlanRequest",
    "WeightFormats",
    "check_fits",
    "expert_bytes",
    "full_flash_config",
    "full_pro_config",
    "plan_memory",
    "shape_config",
]
