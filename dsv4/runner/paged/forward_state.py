"""What one paged forward keeps between its layers: the step's metadata and the tables derived
from it per layer kind (rope angles, compressor tables, prefill chunk tables), the IndexCache
top-k relay, and the switches that decide whether those are shared or rebuilt per layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4.config.index_pattern import IndexPattern
from dsv4.model.rope import inv_freq
from dsv4.ops.rope import rope_cos_sin
from dsv4.runner.paged import kv_rows
from dsv4.runner.paged.compress import CompressorTables, compressor_tables
from dsv4.runner.paged.geometry import LayerGeometry
from dsv4.runner.paged.prefill import ChunkTables, chunk_tables, chunks_of
from dsv4.runner.paged.step_metadata import StepMetadata


@dataclass(frozen=True)
class PagedSwitches:
    """Speed switches of the paged forward (off = the baseline kept for A/B runs)."""

    compressor_boundary_only: bool = True  # #48957: compress programs only for boundaries
    skip_topk: bool = True  # #49486: no indexer q/logits/top-k when every row fits in k
    # the shared expert as one more expert of the grouped GEMM (steps up to
    # FUSE_SHARED_MAX_TOKENS tokens): one launch pair instead of 3 GEMMs + the SwiGLU glue.
    # Off: 1.06x at batch 1 only on the H200, and not bitwise equal to cuBLAS's shared expert
    # (docs/BENCHMARKS.md).
    fuse_shared_expert: bool = False
    # issue 25 (off until timed on the card): decode attention with all heads of a token in one
    # program (kernels/sparse_attention_heads.py; fp8 KV rows, <= 64 heads a rank), and the
    # indexer's fast logits + radix top-k (kernels/indexer_fused.py)
    attention_all_heads: bool = False
    indexer_variants: bool = False
    # issue 22 (off until timed on the card): each MoE layer predicts the next layer's experts
    # (its router on this layer's hidden state; a hash layer's exactly) and an offloaded next
    # layer copies the predicted misses in on the pool's copy stream while this layer computes
    expert_prefetch: bool = False
    # MXFP4 experts re-packed once into the "mxfp4_halves128" layout (kernels/moe_gemv.py to
    # 128 tokens, the halves MMA kernel above: issue 21); "stored": the checkpoint's layout
    mxfp4_layout: str = "stored"
    # "fp8": W4A8 routed experts above the GEMV's sizes (halves128 layout; kernels/moe_w4a8.py:
    # e4m3 x and h on the FP8 MMA, its own numerics: issue 21)
    moe_activations: str = "bf16"


@dataclass
class ForwardState:
    meta: StepMetadata
    chunk_plans: tuple
    switches: PagedSwitches
    index_pattern: IndexPattern | None
    relay: dict[int, tuple] = field(default_factory=dict)
    _rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _comp: dict[int, CompressorTables] = field(default_factory=dict)
    _chunks: dict[int, tuple[ChunkTables, ...]] = field(default_factory=dict)
    _window: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def rope(self, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, rope/2] of every token for layers of `ratio` (plain or YaRN)."""
        key = 0 if ratio == 0 else 1
        if key not in self._rope:
            pos = self.meta.t.positions
            cfg = self.meta.geo.layout.model
            self._rope[key] = rope_cos_sin(pos, inv_freq(cfg, ratio, pos.device))
        return self._rope[key]

    def compressor_tables(self, ratio: int) -> CompressorTables:
        shared = self.meta.switches.shared
        if not shared or ratio not in self._comp:
            # A captured step does not know its boundary tokens on the host: every token gets
            # a program (as the always-launch baseline), non-boundary ones exit at once.
            all_tokens = (not self.switches.compressor_boundary_only
                          or self.meta.shape.host_positions is None)  # fmt: skip
            tables = compressor_tables(self.meta, ratio, all_tokens=all_tokens)
            if not shared:
                return tables
            self._comp[ratio] = tables
        return self._comp[ratio]

    def prefill_chunks(self, ratio: int) -> tuple[ChunkTables, ...]:
        shared = self.meta.switches.shared
        if not shared or ratio not in self._chunks:
            chunks = tuple(
                chunk_tables(self.meta, ratio, c)
                for c in chunks_of(self.meta, self.chunk_plans, ratio)
            )
            if not shared:
                return chunks
            self._chunks[ratio] = chunks
        return self._chunks[ratio]

    def store_window(self, g: LayerGeometry, kv: torch.Tensor) -> None:
        """Every token's K=V row into its window ring slot; a prefill token only if no later
        token of its request in this step reuses the slot."""
        t = self.meta.t
        ring = g.window.slots
        if ring not in self._window:  # shared by every layer with this ring size
            keep = t.positions >= t.ends[t.token_to_req.long()] - ring  # [T] bool
            self._window[ring] = keep, t.positions % ring  # [T] int64 ring row of each token
        keep, row = self._window[ring]
        slots = self.meta.win_base[g.layer_id].long() + row
        kv_rows.store(self.meta.geo, torch.where(keep, slots, -1), kv, self.meta.kernels)
