"""Triton kernels for the DeepSeek-V4 hot path, each beside its torch reference.

Importing the package registers every op (`kernels.registry`); choose an op's implementation
with `kernels.backend.resolve` and a frozen `KernelBackendConfig` (once, then call it;
`dispatch` resolves per call, for tests). From dsv4 the kernels import only `dsv4.ops` and
`dsv4.errors` (docs/architecture.md#import-rules). Under
`TRITON_INTERPRET=1` (set before this import) the Triton versions run on CPU for tests.
"""

from kernels import registry  # noqa: I001  (first: the op modules register into it)
from kernels.backend import KernelBackendConfig, dispatch, resolve, select_backend
from kernels.compressor import compressor_step
from kernels.fp8_linear import fp8_grouped_linear, fp8_linear
from kernels.gated_silu import gated_silu
from kernels.indexer import indexer_logits
from kernels.indexer_fused import indexer_logits_topk
from kernels.indexer_select import indexer_select_all, indexer_topk
from kernels.kv_store import kv_gather, kv_store
from kernels.kv_workspace import kv_workspace
from kernels.mhc import hc_head, hc_post, hc_pre, hc_pre_first_layer
from kernels.metadata import (
    c4_global_topk_slots,
    c128_index_table,
    token_to_req_indices,
    window_slot_table,
)
from kernels.expert_slots import (
    copy_fetched,
    copy_wait_end,
    copy_wait_start,
    prefetch_slots,
    resolve_slots,
)
from kernels.moe import combine_rows, expert_rows, moe_experts
from kernels.moe_align import moe_align
from kernels.norm_rope import norm_rope, rope
from kernels.ring_offsets import ring_offsets
from kernels.routing import hash_route, route
from kernels.sampling import sample
from kernels.sparse_attention import sparse_attention_decode, sparse_attention_prefill
from kernels.sparse_attention_heads import sparse_attention_decode_all_heads
from kernels.step_tables import compressor_tables, window_tables

__all__ = [
    "KernelBackendConfig",
    "c4_global_topk_slots",
    "c128_index_table",
    "combine_rows",
    "compressor_step",
    "compressor_tables",
    "copy_fetched",
    "copy_wait_end",
    "copy_wait_start",
    "dispatch",
    "expert_rows",
    "fp8_grouped_linear",
    "fp8_linear",
    "gated_silu",
    "hash_route",
    "hc_head",
    "hc_post",
    "hc_pre",
    "hc_pre_first_layer",
    "indexer_logits",
    "indexer_logits_topk",
    "indexer_select_all",
    "indexer_topk",
    "kv_gather",
    "kv_store",
    "kv_workspace",
    "moe_align",
    "moe_experts",
    "norm_rope",
    "prefetch_slots",
    "registry",
    "resolve",
    "resolve_slots",
    "ring_offsets",
    "rope",
    "route",
    "sample",
    "select_backend",
    "sparse_attention_decode",
    "sparse_attention_decode_all_heads",
    "sparse_attention_prefill",
    "token_to_req_indices",
    "window_slot_table",
    "window_tables",
]
