"""tools/launch_count.py's tables: which component a launch is counted under, which aten ops
launch, copy, sync or make tensors (its module doc says how they are read)."""

from __future__ import annotations

# registered op -> component; None: its frames decide (a linear, a KV row store or gather)
# (ops not named here: "other")
OP_COMPONENTS = {"hc_pre": "hc_pre", "hc_pre_first_layer": "hc_pre", "hc_post": "hc_post",
                 "hc_head": "head", "norm_rope": "norm_rope", "rope": "rope",
                 "compressor_step": "compressor", "ring_offsets": "compressor",
                 "indexer_select_all": "indexer", "indexer_logits": "indexer",
                 "indexer_topk": "indexer", "indexer_logits_topk": "indexer",
                 "sparse_attention_prefill": "sparse_attention",
                 "sparse_attention_decode": "sparse_attention", "route": "router",
                 "hash_route": "router", "moe_align": "moe_align", "expert_rows": "experts_gemm",
                 "combine_rows": "moe_combine", "moe_experts": "moe_combine", "sample": "sampler",
                 "c128_index_table": "metadata", "c4_global_topk_slots": "metadata",
                 "token_to_req_indices": "metadata", "window_slot_table": "metadata",
                 "window_tables": "metadata", "compressor_tables": "compressor",
                 "fp8_linear": None, "fp8_grouped_linear": None, "kv_store": None,
                 "kv_gather": None, "kv_workspace": None, "gated_silu": None}  # fmt: skip
MODULE_RULES = ((r"\.compressor\b", "compressor"), (r"\.indexer\.", "indexer"),
                (r"attn\.(wq_a|wq_b|wkv|q_norm|kv_norm)$", "qkv_proj"),
                (r"attn\.(wo_a|wo_b)$", "out_proj"), (r"ffn\.shared_experts", "shared_expert"),
                (r"ffn\.gate$", "router"), (r"^embed$", "embed"), (r"^(head|norm)$", "head"),
                (r"(attn|ffn)_norm$", "norm_rope"))  # fmt: skip
# dsv4/ file -> "function[:text on its current line]=component ..." ("*": any function), the
# first match of the innermost frame that has one
FUNCTION_RULES = {
    "runner/paged/forward.py": "_moe:gate_weight=router _moe:shared_experts=shared_expert "
    "_moe=moe_other _block:hc_post=hc_post run:repeat_interleave=hc_pre _sample_rows=head "
    "head_logits=head __call__=metadata",
    "runner/paged/forward_state.py": "prefill_chunks=chunk_tables store_window=kv_store "
    "compressor_tables=compressor rope=metadata",
    "runner/paged/attention.py": "_workspace=workspace _topk=indexer "
    "attention_layer:_project_out=out_proj attention_layer=sparse_attention",
    "runner/paged/step_metadata.py": "*=metadata", "runner/paged/geometry.py": "*=metadata",
    "runner/paged/prefill.py": "*=chunk_tables", "runner/paged/compress.py": "*=compressor",
    "runner/paged/indexer.py": "*=indexer", "model/attention.py": "_project_out=out_proj",
    "model/moe.py": "route=router", "model/block.py": "*:hc_=hc_pre",
    "runner/sampler.py": "*=sampler", "runner/logprobs.py": "*=sampler",
    "runner/paged/graphs.py": "*=metadata", "runner/paged/decode_graphs.py": "*=sampler",
}  # fmt: skip
# token-parallel: rows independent of each other and of the cache (piecewise graphs per token
# bucket could capture them); attention side: cache tables, cache reads/writes, attention
TOKEN_PARALLEL = ("embed", "hc_pre", "hc_post", "norm_rope", "qkv_proj", "rope", "out_proj",
                  "router", "moe_align", "experts_gemm", "moe_combine", "moe_other",
                  "shared_expert", "head")  # fmt: skip
ATTENTION_SIDE = ("compressor", "indexer", "chunk_tables", "workspace", "kv_store",
                  "sparse_attention")  # fmt: skip
NO_LAUNCH = {"view", "_unsafe_view", "_reshape_alias", "as_strided", "slice", "select", "t",
             "transpose", "unsqueeze", "squeeze", "expand", "detach", "alias", "permute",
             "view_as_real", "split", "split_with_sizes", "unbind", "chunk", "narrow",
             "lift_fresh", "empty", "empty_strided", "empty_like", "new_empty", "set_",
             "resize_", "diagonal", "unfold", "sym_size", "sym_stride", "sym_numel",
             "_local_scalar_dense", "is_nonzero", "equal", "record_stream"}  # fmt: skip
SYNC_OPS = {"nonzero", "_unique", "_unique2", "unique_dim", "unique_consecutive", "masked_select",
            "bincount", "_local_scalar_dense", "is_nonzero", "equal"}  # fmt: skip
# one count here, several kernels on CUDA (cub radix sorts and scans, nonzero's count + select)
MULTI_KERNEL = {"aten::sort", "aten::argsort", "aten::topk", "aten::cumsum", "aten::nonzero"}
FACTORIES = {"empty", "zeros", "ones", "full", "arange", "tensor", "as_tensor", "empty_strided",
             "rand", "randn", "randint", "linspace", "eye", "randperm"}  # fmt: skip
