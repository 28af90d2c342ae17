"""Triton kernels for the DeepSeek-V4 hot path, each beside its torch reference.

Importing the package registers every op (`kernels.registry`); call them through the backend
switch (`kernels.backend.dispatch` / `resolve`) with a frozen `KernelBackendConfig`. Under
`TRITON_INTERPRET=1` (set before this import) the Triton versions run on CPU for tests.
"""

from kernels import registry  # noqa: I001  (first: the op modules register into it)
from kernels.backend import KernelBackendConfig, dispatch, resolve, select_backend
from kernels.mhc import hc_head, hc_post, hc_pre, hc_pre_first_layer
from kernels.metadata import (
    c4_global_topk_slots,
    c128_index_table,
    token_to_req_indices,
    window_slot_table,
)
from kernels.routing import hash_route, route

__all__ = [
    "KernelBackendConfig",
    "c4_global_topk_slots",
    "c128_index_table",
    "dispatch",
    "hash_route",
    "hc_head",
    "hc_post",
    "hc_pre",
    "hc_pre_first_layer",
    "registry",
    "resolve",
    "route",
    "select_backend",
    "token_to_req_indices",
    "window_slot_table",
]
