"""Non-weight device memory of one GPU: the KV cache (exact, from `KVLayout`), the step
workspaces, CUDA graph pools and MTP draft buffers (estimates; each formula is stated).

Token counts: T = max_num_batched_tokens (one step: prefill chunk + decodes), S =
max_num_seqs, k = speculative tokens, L = max_model_len. Activations are bf16 unless noted.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from dsv4.cache.layout import KVLayout
from dsv4.cache.packing import CacheOptions
from dsv4.config.model import ModelConfig
from dsv4.model.inventory import model_tensors, quantized_kind

# Transient bf16 copies that weights held as stored make in large steps: the kernels' thresholds,
# from the torch-free module the kernels read them from.
from dsv4.ops.limits import (
    FP8_GEMV_MAX_ROWS,
    MOE_DEQUANT_MIN_PAIRS_PER_EXPERT,
    MOE_DEQUANT_SCRATCH_BYTES,
)
from dsv4.scheduler.policy import worst_case_width_rows

BF16, FP32 = 2, 4
GRAPH_NODE_BYTES = 2 * 1024**2  # per captured graph: kernel nodes and their parameters


@dataclass(frozen=True)
class KindKV:
    kind: str  # swa | c4 | c128
    num_layers: int
    paged_bytes_per_token: float  # per layer: compressed KV + indexer keys
    ring_bytes_per_request: int  # per layer: window ring + compressor state rings


@dataclass(frozen=True)
class KVPlan:
    kinds: tuple[KindKV, ...]
    block_size: int
    block_stride_bytes: int  # one block holds every layer's page (packed layout)
    num_ring_blocks: int  # per request
    bytes_per_request: int  # ring + token blocks of one max_model_len request
    num_blocks: int  # for max_num_seqs requests
    total_bytes: int


@dataclass(frozen=True)
class Buffer:
    name: str
    nbytes: int
    formula: str  # how it was estimated (shown by `dsv4 plan`)


def kv_plan(
    cfg: ModelConfig, options: CacheOptions, max_model_len: int, max_num_seqs: int
) -> KVPlan:
    """KV for `max_num_seqs` requests of `max_model_len` tokens each, in whole blocks.

    NOTE: KV is replicated on every TP rank (one shared K=V latent head, nothing to split).
    """
    layout = KVLayout.build(cfg, options)
    per_kind = layout.bytes_per_token()
    kinds = tuple(
        KindKV(kind, fp.num_layers, fp.paged_bytes_per_token, fp.ring_bytes_per_request)
        for kind, fp in sorted(per_kind.items())
    )
    blocks_per_request = layout.num_blocks_for_request(max_model_len)
    num_blocks = blocks_per_request * max_num_seqs
    return KVPlan(
        kinds=kinds,
        block_size=layout.block_size,
        block_stride_bytes=layout.block_stride_bytes,
        num_ring_blocks=layout.num_ring_blocks,
        bytes_per_request=blocks_per_request * layout.block_stride_bytes,
        num_blocks=num_blocks,
        total_bytes=num_blocks * layout.block_stride_bytes,
    )


def _hidden(cfg: ModelConfig, tokens: int) -> Buffer:
    m, d = cfg.hc_mult, cfg.hidden_size
    nbytes = tokens * (2 * m * d * BF16 + 2 * d * FP32)
    return Buffer("hidden", nbytes, f"T={tokens} x (2 residual streams [M,D] bf16 + 2 [D] fp32)")


def _attention(
    cfg: ModelConfig, tokens: int, tp: int, max_model_len: int, area_rows: int
) -> list[Buffer]:
    heads = cfg.num_attention_heads // tp
    q_o = tokens * (2 * heads * cfg.head_dim + cfg.o_groups // tp * cfg.o_lora_rank) * BF16
    out = [Buffer("attention_qo", q_o, f"T x (q + o [H/tp={heads}, {cfg.head_dim}] + wo_a) bf16")]
    if area_rows:
        out.append(
            Buffer(
                "attention_area",
                area_rows * cfg.head_dim * BF16,
                f"area planner budget {area_rows} rows x [{cfg.head_dim}] bf16 (prefill gather)",
            )
        )
    if 4 in cfg.compress_ratios:
        n_index = math.ceil(max_model_len / 4)
        logits = tokens * n_index * FP32
        q = tokens * cfg.index_n_heads * cfg.index_head_dim * BF16
        out.append(
            Buffer("indexer_logits", logits + q, f"T x ceil(L/4)={n_index} fp32 + indexer q")
        )
    return out


def _moe(cfg: ModelConfig, tokens: int, moe_tp: int) -> Buffer:
    k, d, inter = cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size // moe_tp
    nbytes = tokens * k * (2 * d + 3 * inter) * BF16 + tokens * d * FP32
    return Buffer(
        "moe_intermediate",
        nbytes,
        f"T x top-{k} x (in + out [D] + gate/up/act [I/tp={inter}]) bf16 + fp32 combine",
    )


def step_workspace(
    cfg: ModelConfig,
    tokens: int,
    num_seqs: int,
    tp: int,
    moe_tp: int,
    max_model_len: int,
    area_rows: int,
) -> tuple[Buffer, ...]:
    """Peak of one step: hidden + the larger of attention (incl. the prefill area workspace
    and the C4 indexer logits of the chunk) and MoE, + last-token logits of every sequence."""
    attn = _attention(cfg, tokens, tp, max_model_len, area_rows)
    moe = _moe(cfg, tokens, moe_tp)
    phase = attn if sum(b.nbytes for b in attn) >= moe.nbytes else [moe]
    vocab = -(-cfg.vocab_size // tp)
    logits = Buffer("logits", num_seqs * vocab * FP32 * 2, f"S={num_seqs} x V/tp fp32 x 2")
    return (_hidden(cfg, tokens), *phase, logits)


def area_budget_rows(
    cfg: ModelConfig,
    max_model_len: int,
    max_num_batched_tokens: int,
    group_size: int = 4,
    chunk_area_budget: int = 0,
) -> int:
    """Rows of the prefill attention workspace: the scheduler's area budget (widest ratio)."""
    if chunk_area_budget:
        return chunk_area_budget
    ratios = [r for r in cfg.compress_ratios if r] or [0]
    width = max(
        worst_case_width_rows(
            r,
            max_model_len=max_model_len,
            window=cfg.sliding_window,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        for r in ratios
    )
    return group_size * width


def graph_sizes(max_decode_tokens: int) -> list[int]:
    """Captured decode batch sizes: 1, 2, 4, then every multiple of 8 (vLLM-like)."""
    sizes = [s for s in (1, 2, 4) if s <= max_decode_tokens]
    return sizes + list(range(8, max_decode_tokens + 1, 8))


def cuda_graph_pool(cfg: ModelConfig, num_seqs: int, k: int, tp: int, moe_tp: int) -> Buffer:
    """One memory pool shared by every captured decode graph: the activations of the largest
    captured batch (S x (1 + k) tokens, no prefill area) + a fixed cost per graph."""
    tokens = num_seqs * (1 + k)
    peak = step_workspace(cfg, tokens, num_seqs, tp, moe_tp, max_model_len=0, area_rows=0)
    num_graphs = len(graph_sizes(tokens))
    nbytes = sum(b.nbytes for b in peak) + num_graphs * GRAPH_NODE_BYTES
    return Buffer(
        "cuda_graphs",
        nbytes,
        f"decode activations at {tokens} tokens + {num_graphs} graphs x 2 MiB (estimate)",
    )


def mtp_buffers(cfg: ModelConfig, num_seqs: int, k: int, tp: int) -> Buffer:
    """Draft logits [S, k, V/tp] fp32 and draft streams [S, 1 + k, M, D] bf16."""
    vocab = -(-cfg.vocab_size // tp)
    nbytes = num_seqs * k * vocab * FP32 + num_seqs * (1 + k) * cfg.hc_mult * cfg.hidden_size * BF16
    return Buffer("mtp_draft", nbytes, f"S x k={k} x V/tp fp32 logits + S x (1+k) streams bf16")


def dequant_workspace(
    cfg: ModelConfig,
    tokens: int,
    num_local_experts: int,
    moe_tp: int,
    experts_as_stored: bool,
    linears_as_stored: bool,
) -> list[Buffer]:
    """Transient bf16 weights of a step of `tokens`: the MXFP4 experts' dequantise scratch
    (kernels/moe_dequant.py, from MOE_DEQUANT_MIN_PAIRS_PER_EXPERT pairs an expert) and the
    largest FP8 linear dequantised for cuBLAS (one at a time, above FP8_GEMV_MAX_ROWS rows)."""
    out = []
    pairs = tokens * cfg.num_experts_per_tok
    fp4_experts = experts_as_stored and cfg.expert_dtype == "fp4"
    if fp4_experts and pairs >= MOE_DEQUANT_MIN_PAIRS_PER_EXPERT * num_local_experts:
        per_expert = 3 * cfg.hidden_size * (cfg.moe_intermediate_size // moe_tp) * BF16
        chunk = min(num_local_experts, max(1, MOE_DEQUANT_SCRATCH_BYTES // per_expert))
        out.append(Buffer("moe_dequant_scratch", chunk * per_expert,
                          f"{chunk} experts x 3 x D x I/tp bf16 (MXFP4 steps of >= "
                          f"{MOE_DEQUANT_MIN_PAIRS_PER_EXPERT} pairs an expert)"))  # fmt: skip
    if linears_as_stored and cfg.linear_dtype == "fp8" and tokens > FP8_GEMV_MAX_ROWS:
        largest = _largest_fp8_linear(cfg)
        out.append(Buffer("fp8_linear_dequant", largest * BF16,
                          "the largest FP8 linear as bf16, one at a time"))  # fmt: skip
    return out


@functools.lru_cache(maxsize=16)  # a Pro inventory is ~140k tensors; a plan asks twice
def _largest_fp8_linear(cfg: ModelConfig) -> int:
    """Elements of the largest linear a checkpoint stores as FP8 (experts aside)."""
    return max(
        math.prod(spec.shape)
        for spec in model_tensors(cfg)
        if quantized_kind(spec.name, cfg) == "fp8" and ".ffn.experts." not in spec.name
    )
