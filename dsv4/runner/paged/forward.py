"""The paged forward: one step's tokens, flat [T], through the model on the paged cache.

Same math as `DeepseekV4.forward` over per-request states (docs/model.md#forward), but every layer
runs batched over all tokens of the step and reads/writes the packed cache in place through the
kernels (sparse attention, indexer, compressor, grouped MoE, mHC, routing), selected per op by
the kernel config ("auto": Triton on CUDA, the torch references on CPU). The reference path
(`dsv4.runner.reference`: `cache_state.load_states` + the model + `store_state`) stays the
oracle it is tested against.

Logits are computed only for the rows that sample (the last token of each sampling request);
prompt logprobs run `head_logits` over the rows they need, from the streams (`PagedOutput`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsv4.errors import ConfigError
from dsv4.model.block import Block
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.model.fp8 import FP8Linear
from dsv4.model.layers import RMSNorm, linear_fp32
from dsv4.model.moe import MXFP4_LAYOUTS, Expert, MoE
from dsv4.runner.kv_cache import PagedKVCache
from dsv4.runner.paged.attention import attention_layer
from dsv4.runner.paged.collectives import ONE_RANK, PagedCollectives
from dsv4.runner.paged.forward_state import ForwardState, PagedSwitches
from dsv4.runner.paged.geometry import CacheGeometry
from dsv4.runner.paged.step_metadata import MetadataSwitches, StepMetadata, StepTokens, upload
from dsv4.runner.paged.weights import LayerWeights, prepare_weights
from dsv4.scheduler.batch import ScheduledBatch
from kernels.backend import KernelBackendConfig, resolve

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from dsv4.runner.paged.expert_pool import ExpertPool
    from dsv4.runner.routing_stats import RoutingStats

# Largest step the shared expert joins the grouped GEMM at: decode batches, where it saves
# launches; a long prefill keeps cuBLAS's dense GEMMs (the grouped kernel reaches ~35% of the
# bf16 peak at 8192 tokens, dense GEMMs more).
FUSE_SHARED_MAX_TOKENS = 256

DEFAULT_METADATA = MetadataSwitches()
DEFAULT_SWITCHES = PagedSwitches()


@dataclass(frozen=True)
class PagedOutput:
    logits: torch.Tensor  # [num_sample_rows, V] fp32
    streams: torch.Tensor  # [T, M, D]: final streams of every token (the MTP layer's input)
    tokens: StepTokens


class PagedForward:
    """Owned by the runner (engine thread); built once per cache. On a rank of a sharded
    replica `model` is the rank's shard and `collectives` its hooks (`collectives.py`)."""

    def __init__(
        self,
        model: DeepseekV4,
        cache: PagedKVCache,
        kernels: KernelBackendConfig,
        metadata: MetadataSwitches = DEFAULT_METADATA,
        switches: PagedSwitches = DEFAULT_SWITCHES,
        collectives: PagedCollectives = ONE_RANK,
    ) -> None:
        self.model, self.cache = model, cache
        self.collectives = collectives
        self.cfg = model.cfg
        self.geo = CacheGeometry(cache.layout, cache.backing)
        self.kernels = kernels
        self.metadata = metadata
        self.switches = switches
        self.weights = prepare_weights(model, switches.mxfp4_layout)
        held = sorted({lw.experts.format for lw in self.weights})
        if switches.moe_activations == "fp8" and held != [MXFP4_LAYOUTS["halves128"]]:
            logger.warning("features.moe_activations fp8: routed experts held as %s, not "
                           "mxfp4_halves128 (bf16 experts, or dimensions not whole 128-column "
                           "blocks): W4A8 does not apply, they run exact", held)  # fmt: skip
        if switches.fuse_shared_expert:
            _check_fusable(model, self.weights)
        self.device = model.embed.weight.device
        dev = self.device
        self._ops = {name: resolve(name, kernels, dev) for name in
                     ("hc_pre", "hc_pre_first_layer", "hc_post", "hc_head", "moe_experts",
                      "norm_rope", "gated_silu")}  # fmt: skip
        self._route = resolve("route", kernels, dev)
        self._hash_route = resolve("hash_route", kernels, dev)
        # expert popularity (metrics.routing_stats): set before graphs are captured
        self.routing_stats: RoutingStats | None = None
        # offloaded experts (expert_pool.py): the layers' pools share one ExpertPool
        self.expert_pool: ExpertPool | None = next(
            (lw.pool.owner_pool for lw in self.weights if lw.pool is not None), None
        )
        # per main layer i: layer i + 1's MoE when its pool prefetches (switches.expert_prefetch)
        self._ahead = self._prefetch_targets()

    @torch.no_grad()
    def __call__(
        self, batch: ScheduledBatch, drafts: dict[str, tuple[int, ...]] | None = None
    ) -> PagedOutput:
        """One eager step. `drafts` (request id -> its scheduled draft tokens) are appended to
        each decode's token; each of those positions then samples (MTP verification)."""
        requests = batch.requests
        tokens = StepTokens.of(requests)
        ids = []
        for r in requests:
            ids.extend(r.token_ids)
            if r.num_draft_tokens:
                ids.extend(_drafts_of(r, drafts))
        t = upload(tokens, ids, self.device, self.geo)  # host tables in the one upload
        meta = StepMetadata(tokens.shape, tokens, t, self.geo, self.kernels, self.metadata)
        logits, x = self.run(meta, batch.chunk_plans)
        return PagedOutput(logits, x, tokens)

    def run(self, meta: StepMetadata, chunk_plans: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers on a step's metadata -> (logits [sample rows, V] fp32, streams [T, M, D]).
        Reads only device tensors and `meta.shape`, so a static step can be graph-captured."""
        pattern = None if self.model.index_pattern.is_all_full else self.model.index_pattern
        fs = ForwardState(meta, chunk_plans, self.switches, pattern)
        if self.routing_stats is not None:  # which tokens count (not a graph's padding rows)
            self.routing_stats.begin_step(meta.t)
        cfg, t = self.cfg, meta.t
        first_moe = self.model.layers[0].ffn
        if (
            self.switches.expert_prefetch
            and self.weights[0].pool is not None
            and first_moe.gate.is_hash
        ):
            # layer 0 routes by token id: its experts are known before the step, so they are
            # copied in while its attention runs
            self.weights[0].pool.prefetch(first_moe.gate.tid2eid[t.token_ids.long()])
        x = self.model.embed(t.token_ids)  # [T, D]
        fused_first = self.model.fuse_first_hc
        if not fused_first:
            x = x.unsqueeze(-2).repeat_interleave(cfg.hc_mult, dim=-2).contiguous()  # [T, M, D]
        for i, block in enumerate(self.model.layers):
            x = self._block(block, self.weights[i], fs, x, t.token_ids, fused_first and i == 0,
                            self._ahead[i])  # fmt: skip
        return self.head_logits(self._sample_rows(meta, x)), x

    def head_logits(self, streams: torch.Tensor) -> torch.Tensor:
        """Final streams [R, M, D] (any row stride, channels contiguous) -> logits [R, V] fp32:
        hc_head, the final norm, the lm head (the sample rows' here; prompt logprobs' rows too)."""
        m, cfg = self.model, self.cfg
        h = self._ops["hc_head"](streams, m.hc_head_fn, m.hc_head_scale, m.hc_head_base,
                                 cfg.hc_eps, cfg.rms_norm_eps)  # [R, D] bf16  # fmt: skip
        return m.head(self._norm(m.norm, h)).float()

    def run_mtp(self, meta: StepMetadata, streams: torch.Tensor,
                select: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The MTP layer (docs/model.md#mtp) on a step whose flat token i is at MTP position
        p_i: `streams` [T, M, D] are the final streams at p_i (the target's, or the MTP's own
        for a draft step) and `meta.t.token_ids` the tokens at p_i + 1. Its window rows go
        into the MTP ring. -> (draft logits [rows, V] fp32 for the tokens at p_i + 2 of the
        rows `select` [n] (device) or the shape's sample rows, post-block streams [T, M, D])."""
        cfg, mtp = self.cfg, self.model.mtp[0]
        fs = ForwardState(meta, (), self.switches, None)
        if self.routing_stats is not None:
            self.routing_stats.begin_step(meta.t)
        ids = meta.t.token_ids
        e = mtp.e_proj(self._norm(mtp.enorm, self.model.embed(ids)))  # [T, D]
        x = mtp.h_proj(self._norm(mtp.hnorm, streams)) + e.unsqueeze(-2)  # [T, M, D]
        x = self._block(mtp, self.weights[-1], fs, x, ids, False)
        rows = x[select] if select is not None else self._sample_rows(meta, x)
        h = self._ops["hc_head"](rows.contiguous(), mtp.hc_head_fn, mtp.hc_head_scale,
                                 mtp.hc_head_base, cfg.hc_eps, cfg.rms_norm_eps)  # fmt: skip
        return self.model.head(self._norm(mtp.norm, h)).float(), x

    def _sample_rows(self, meta: StepMetadata, x: torch.Tensor) -> torch.Tensor:
        """x [T, M, D] -> the sampling rows [R, M, D]: a strided view when they are evenly
        spaced (one row, or a decode batch's 0..B-1: no upload, no gather launch), else a
        gather through an uploaded index."""
        rows = meta.shape.sample_rows
        if rows is None:
            return x.contiguous()
        step = rows[1] - rows[0] if len(rows) > 1 else 1
        if rows and step > 0 and rows == tuple(range(rows[0], rows[-1] + 1, step)):
            return x[rows[0] : rows[-1] + 1 : step]  # hc_head takes any row stride
        # non_blocking: a pageable upload without it waits for the stream (the step's last sync
        # before sampling); with it the rows are staged and the copy queues behind the layers
        index = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        return x[index].contiguous()

    def _prefetch_targets(self) -> list[tuple[MoE, LayerWeights] | None]:
        layers = self.model.layers
        if not self.switches.expert_prefetch:
            return [None] * len(layers)
        return [(layers[i + 1].ffn, self.weights[i + 1])
                if i + 1 < len(layers) and self.weights[i + 1].pool is not None else None
                for i in range(len(layers))]  # fmt: skip

    def _norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm `norm` on x [..., D] in one launch (its torch form is 9)."""
        return self._ops["norm_rope"](x, norm.weight, norm.eps)

    def _block(self, block: Block, lw: LayerWeights, fs: ForwardState, x, token_ids, first,
               ahead: tuple[MoE, LayerWeights] | None = None):  # fmt: skip
        """x [T, M, D] (or the embedding [T, D] for the fused first block) -> [T, M, D];
        `ahead`: the next layer's MoE, whose experts this block's MoE prefetches."""
        u, post, comb = block.hc_attn(x, self._ops["hc_pre_first_layer" if first else "hc_pre"])
        norm = self._ops["norm_rope"]  # rms_norm in one launch
        y = attention_layer(
            block.attn, lw, fs, norm(u, block.attn_norm.weight, block.attn_norm.eps)
        )
        y = self.collectives.after_attention(y)  # [T, D]: the sum over the ranks' heads
        x = self._ops["hc_post"](y.contiguous(), x, post, comb)
        u, post, comb = block.hc_ffn(x, self._ops["hc_pre"])
        y = self._moe(block.ffn, lw, norm(u, block.ffn_norm.weight, block.ffn_norm.eps),
                      token_ids, ahead)  # fmt: skip
        return self._ops["hc_post"](y.contiguous(), x, post, comb)

    def _moe(self, moe: MoE, lw: LayerWeights, u: torch.Tensor, token_ids: torch.Tensor,
             ahead: tuple[MoE, LayerWeights] | None = None):  # fmt: skip
        """u [T, D] -> [T, D]: routing, the grouped routed experts (in their served format:
        bf16, or the checkpoint's MXFP4 / FP8 dequantised in the kernel), the shared expert."""
        cfg, experts = self.cfg, lw.experts
        logits = linear_fp32(u, lw.gate_weight)  # [T, E] fp32
        w, ids = moe.route(logits, token_ids, self._route, self._hash_route, lw.gate_bias)
        if self.routing_stats is not None:  # counts[layer of moe] += selections, on the device
            self.routing_stats.record(moe, ids)
        if ahead is not None:  # before this layer's experts, so the copies run beside them
            self._prefetch(*ahead, u, token_ids)
        if lw.pool is not None:  # offloaded experts (one rank only): the layer's pool, never fused
            y = lw.pool.experts(u.contiguous(), ids, w, cfg.swiglu_limit,
                                lookahead=self.switches.expert_prefetch)  # fmt: skip
            if moe.shared_experts is not None:  # bf16 -> fp32 inside the add (exact)
                y += self._shared_expert(moe.shared_experts, u)
            return self.collectives.after_moe(y).to(u.dtype)
        w, ids = self.collectives.local_experts(w, ids)  # global ids -> this rank's slots
        w13, w2, num_t = experts.w13, experts.w2, u.shape[0]
        fuse = (self.switches.fuse_shared_expert and experts.w13_all is not None
                and num_t <= FUSE_SHARED_MAX_TOKENS)  # fmt: skip
        if fuse:  # every token also to slot E (the shared expert) with weight 1
            shared = torch.full((num_t, 1), w13.shape[0], dtype=ids.dtype, device=ids.device)
            ids, w = torch.cat((ids, shared), 1), torch.cat((w, torch.ones_like(w[:, :1])), 1)
            w13, w2 = experts.w13_all, experts.w2_all
        # one rank: the shared expert's output [T, D] joins the routed sum in the combine's
        # launch, which rounds to u's dtype (the add and the cast below, 2 launches fewer)
        shared = None
        if moe.shared_experts is not None and not fuse and self.collectives is ONE_RANK:
            shared = self._shared_expert(moe.shared_experts, u)
        y = self._ops["moe_experts"](u.contiguous(), ids, w, w13, w2, experts.format,
                                     experts.w13_scale, experts.w2_scale,
                                     limit=cfg.swiglu_limit,
                                     skip=self.collectives.skips_pairs,
                                     activations=self.switches.moe_activations,
                                     shared=shared)  # [T, D] fp32 (u's dtype with shared)  # fmt: skip
        if shared is not None:
            return y
        if moe.shared_experts is not None and not fuse:  # bf16 -> fp32 inside the add (exact)
            y += self._shared_expert(moe.shared_experts, u)
        return self.collectives.after_moe(y).to(u.dtype)  # the sum over the ranks' experts

    def _shared_expert(self, expert: Expert, u: torch.Tensor) -> torch.Tensor:
        """`Expert.forward` through the expert's own linears (dense or FP8Linear), u [T, D] ->
        [T, D]; its activation (torch: ~7 launches) is the resolved gated_silu op, one launch
        with the same output bits (kernels/gated_silu.py)."""
        h = self._ops["gated_silu"](expert.w1(u), expert.w3(u), expert.limit)  # [T, I]
        return expert.w2(h)

    def _prefetch(self, moe: MoE, lw: LayerWeights, u: torch.Tensor, token_ids: torch.Tensor):
        """Pre-gating: the next layer's router on this layer's MoE input u [T, D] predicts its
        experts [T, K] (a hash layer's are exact: they follow the token ids), and its pool
        copies the predicted misses in on the copy stream (`LayerPool.prefetch`)."""
        assert lw.pool is not None
        logits = linear_fp32(u, lw.gate_weight)  # [T, E] fp32
        _, predicted = moe.route(logits, token_ids, self._route, self._hash_route, lw.gate_bias)
        lw.pool.prefetch(predicted)


def _check_fusable(model: DeepseekV4, weights: tuple[LayerWeights, ...]) -> None:
    """The grouped GEMM takes one weight format per launch: the shared expert (dequantised at
    load) cannot join routed experts held in the checkpoint's MXFP4 / FP8, nor can a shared
    expert held as FP8 (`features.linear_weights=checkpoint`) join bf16 ones."""
    shared = [m.shared_experts for m in model.modules() if isinstance(m, MoE)]
    if any(s is not None and isinstance(s.w1, FP8Linear) for s in shared):
        raise ConfigError("features.fuse_shared_expert", True,
                          "the shared expert is held as FP8 (features.linear_weights="
                          "checkpoint) and one grouped GEMM takes one format: turn "
                          "fuse_shared_expert off or serve linear_weights=bf16")  # fmt: skip
    for lw in weights:
        if lw.experts.is_quantized:
            raise ConfigError("features.fuse_shared_expert", True,
                              f"the routed experts are served as {lw.experts.format} "
                              "(features.expert_weights=checkpoint) and the shared expert "
                              "dequantised, and one grouped GEMM takes one format: turn "
                              "fuse_shared_expert off or serve expert_weights=bf16")  # fmt: skip


def _drafts_of(request, drafts: dict[str, tuple[int, ...]] | None) -> tuple[int, ...]:
    found = (drafts or {}).get(request.request_id, ())
    if len(found) != request.num_draft_tokens:
        raise ValueError(f"{request.request_id}: {request.num_draft_tokens} draft tokens "
                         f"scheduled, {len(found)} given")  # fmt: skip
    return found
