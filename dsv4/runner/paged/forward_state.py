"""What one paged forward keeps between its layers: the step's metadata and the tables derived
from it per layer kind (rope angles, compressor tables, prefill chunk tables), the IndexCache
top-k relay, and the switches that decide whether those are shared or rebuilt per layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
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
    _window: dict[int, tuple[torch.Tensor, bool]] = field(default_factory=dict)
    _stored: set[int] = field(default_factory=set)  # layers a workspace launch stored rows of

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

    def window_slots(self, g: LayerGeometry) -> tuple[torch.Tensor, bool]:
        """([T] int32 ring-relative slot of every token's K=V row, -1 for a prefill token whose
        slot a later token of its request in this step reuses; whether no prefill workspace of
        the step reads one of those slots), shared by every layer with this ring size."""
        t, ring = self.meta.t, g.window.slots
        if ring not in self._window:
            rel = self.meta.win_rel if ring == self.meta.geo.layers[0].window.slots else None
            if rel is None:  # another ring size, or an upload without the window tables
                keep = t.positions >= t.ends[t.token_to_req.long()] - ring  # [T] bool
                rel = torch.where(keep, t.positions % ring, -1).int()
            self._window[ring] = rel, self._no_stored_slot_read(ring)
        return self._window[ring]

    def _no_stored_slot_read(self, ring: int) -> bool:
        """A prefill request's workspace reads its window prefix (min(start, W - 1) positions
        before `start`) and the step stores its last `ring` positions: the two share a ring slot
        iff there is a prefix and the positions from its first to `end` outnumber the slots."""
        tokens = self.meta.tokens
        if tokens is None:  # a captured (decode) step: no workspaces
            return False
        d, w = tokens.num_decode_requests, self.meta.geo.layout.model.sliding_window
        starts = np.asarray(tokens.starts[d:], dtype=np.int64)  # [prefills]
        ends = np.asarray(tokens.ends[d:], dtype=np.int64)
        prefix = np.minimum(starts, w - 1)
        return bool(np.all((prefix == 0) | (ends - starts + prefix <= ring)))

    def claim_window_store(self, g: LayerGeometry) -> torch.Tensor | None:
        """The ring-relative store slots [T] int32 for a workspace launch of layer `g` to store
        the step's window rows with (`kernels.kv_workspace`: its reads and stores run side by
        side, so only when no workspace reads a stored slot); the first claim of a layer gets
        them, and `store_window` then stores nothing. None: `store_window` stores."""
        rel, fusable = self.window_slots(g)
        if not fusable or g.layer_id in self._stored:
            return None
        self._stored.add(g.layer_id)
        return rel

    def store_window(self, g: LayerGeometry, kv: torch.Tensor) -> None:
        """Every token's K=V row into its window ring slot; a prefill token only if no later
        token of its request in this step reuses the slot (unless a workspace launch of the
        layer stored them: `claim_window_store`)."""
        if g.layer_id in self._stored:
            return
        rel, _ = self.window_slots(g)
        kv_rows.store_window(self.meta.geo, rel, self.meta.win_base[g.layer_id], kv,
                             self.meta.kernels)  # fmt: skip
