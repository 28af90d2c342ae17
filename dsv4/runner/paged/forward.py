"""The paged forward: one step's tokens, flat [T], through the model on the paged cache.

Same math as `DeepseekV4.forward` over per-request states (DSV4_ARCH.md §3), but every layer
runs batched over all tokens of the step and reads/writes the packed cache in place through the
kernels (sparse attention, indexer, compressor, grouped MoE, mHC, routing), selected per op by
the kernel config ("auto": Triton on CUDA, the torch references on CPU). The reference path
(`paged_state.load_states` + the model + `store_state`) stays the oracle it is tested against.

Logits are computed only for the rows that sample (the last token of each sampling request).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.model.block import Block
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.model.moe import MoE
from dsv4.runner.paged.attention import attention_layer
from dsv4.runner.paged.forward_state import ForwardState, PagedSwitches
from dsv4.runner.paged.geometry import CacheGeometry
from dsv4.runner.paged.step import MetadataSwitches, StepMetadata, StepTokens, upload
from dsv4.runner.paged.weights import ExpertWeights, LayerWeights, prepare_weights
from dsv4.runner.paged_cache import PagedKVCache
from dsv4.scheduler.batch import ScheduledBatch
from kernels.backend import KernelBackendConfig, resolve

DEFAULT_METADATA = MetadataSwitches()
DEFAULT_SWITCHES = PagedSwitches()


@dataclass(frozen=True)
class PagedOutput:
    logits: torch.Tensor  # [num_sample_rows, V] fp32
    streams: torch.Tensor  # [T, M, D]: final streams of every token (the MTP layer's input)
    tokens: StepTokens


class PagedForward:
    """Owned by the runner (engine thread); built once per cache."""

    def __init__(
        self,
        model: DeepseekV4,
        cache: PagedKVCache,
        kernels: KernelBackendConfig,
        metadata: MetadataSwitches = DEFAULT_METADATA,
        switches: PagedSwitches = DEFAULT_SWITCHES,
    ) -> None:
        self.model = model
        self.cfg = model.cfg
        self.geo = CacheGeometry(cache.layout, cache.backing)
        self.kernels = kernels
        self.metadata = metadata
        self.switches = switches
        self.weights = prepare_weights(model)
        self.device = model.embed.weight.device
        dev = self.device
        self._ops = {name: resolve(name, kernels, dev) for name in
                     ("hc_pre", "hc_pre_first_layer", "hc_post", "hc_head", "moe_experts")}  # fmt: skip
        self._route = resolve("route", kernels, dev)
        self._hash_route = resolve("hash_route", kernels, dev)

    @torch.no_grad()
    def __call__(self, batch: ScheduledBatch) -> PagedOutput:
        requests = batch.requests
        tokens = StepTokens.of(requests)
        if any(r.num_draft_tokens for r in requests):
            raise NotImplementedError("MTP drafts run on the reference forward")
        ids = [tok for r in requests for tok in r.token_ids]
        t = upload(tokens, ids, self.device)
        meta = StepMetadata(tokens, t, self.geo, self.kernels, self.metadata)
        pattern = None if self.model.index_pattern.is_all_full else self.model.index_pattern
        fs = ForwardState(meta, batch.chunk_plans, self.switches, pattern)
        cfg = self.cfg
        x = self.model.embed(t.token_ids)  # [T, D]
        fused_first = self.model.fuse_first_hc
        if not fused_first:
            x = x.unsqueeze(-2).repeat_interleave(cfg.hc_mult, dim=-2).contiguous()  # [T, M, D]
        for i, block in enumerate(self.model.layers):
            x = self._block(block, self.weights[i], fs, x, t.token_ids, fused_first and i == 0)
        rows = torch.tensor(tokens.sample_rows, dtype=torch.long).to(self.device)
        m = self.model
        h = self._ops["hc_head"](x[rows].contiguous(), m.hc_head_fn, m.hc_head_scale,
                                 m.hc_head_base, cfg.hc_eps, cfg.rms_norm_eps)  # fmt: skip
        logits = m.head(m.norm(h)).float()
        return PagedOutput(logits, x, tokens)

    def _block(self, block: Block, lw: LayerWeights, fs: ForwardState, x, token_ids, first):
        """x [T, M, D] (or the embedding [T, D] for the fused first block) -> [T, M, D]."""
        cfg = self.cfg
        hc = (cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        params = (block.hc_attn_fn, block.hc_attn_scale, block.hc_attn_base)
        pre = self._ops["hc_pre_first_layer" if first else "hc_pre"]
        u, post, comb = pre(x, *params, *hc)
        y = attention_layer(block.attn, lw, fs, block.attn_norm(u))
        x = self._ops["hc_post"](y.contiguous(), x, post, comb)
        params = (block.hc_ffn_fn, block.hc_ffn_scale, block.hc_ffn_base)
        u, post, comb = self._ops["hc_pre"](x, *params, *hc)
        y = self._moe(block.ffn, lw.experts, block.ffn_norm(u), token_ids)
        return self._ops["hc_post"](y.contiguous(), x, post, comb)

    def _moe(self, moe: MoE, experts: ExpertWeights, u: torch.Tensor, token_ids: torch.Tensor):
        """u [T, D] -> [T, D]: routing, the grouped routed experts, the dense shared expert."""
        cfg = self.cfg
        logits = torch.nn.functional.linear(u.float(), moe.gate.weight.float())  # [T, E] fp32
        if moe.gate.is_hash:
            w, ids = self._hash_route(
                logits, token_ids, moe.gate.tid2eid, cfg.routed_scaling_factor
            )
        else:
            w, ids = self._route(logits, moe.gate.bias.float(), cfg.num_experts_per_tok,
                                 cfg.routed_scaling_factor)  # fmt: skip
        y = self._ops["moe_experts"](u.contiguous(), ids, w, experts.w13, experts.w2,
                                     limit=cfg.swiglu_limit)  # [T, D] fp32  # fmt: skip
        if moe.shared_experts is not None:
            y += moe.shared_experts(u).float()
        return y.to(u.dtype)
