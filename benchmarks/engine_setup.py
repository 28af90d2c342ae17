"""Shared set-up of the engine benchmarks: the Flash-shaped model, an engine core on it, paged
forward variants (one per switch at its baseline), and the roofline arithmetic.

Variants share the model's weights (the stacked experts are built once) and the core's cache,
so an A/B pair runs the same step on the same bytes.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from dsv4.cache.packing import CacheOptions
from dsv4.config.model import ModelConfig, flash_config, tiny_config
from dsv4.engine.core import EngineOptions, build_engine_core
from dsv4.model.tiny import random_model
from dsv4.runner.kernel_bridge import hot_ops
from dsv4.runner.paged import MetadataSwitches, PagedForward, PagedOptions, PagedSwitches
from dsv4.runner.routing_stats import RoutingStats
from dsv4.scheduler.config import SchedulerConfig
from dsv4.scheduler.request import Request
from kernels.backend import KernelBackendConfig

PEAK_BYTES_PER_S = 4.3e12
PEAK_FLOPS = 790e12

# switch name -> (metadata switches, paged switches, kernel overrides, fused first mHC)
VARIANTS: dict[str, tuple[MetadataSwitches, PagedSwitches, dict[str, str], bool]] = {
    "all_on": (MetadataSwitches(), PagedSwitches(), {}, True),
    "shared_sparse_metadata_off": (MetadataSwitches(shared=False), PagedSwitches(), {}, True),
    "cached_token_to_req_off": (
        MetadataSwitches(cached_token_to_req=False), PagedSwitches(), {}, True,
    ),
    "skip_redundant_fill_off": (
        MetadataSwitches(skip_redundant_fill=False), PagedSwitches(), {}, True,
    ),
    "compressor_boundary_only_off": (
        MetadataSwitches(), PagedSwitches(compressor_boundary_only=False), {}, True,
    ),
    "skip_topk_off": (MetadataSwitches(), PagedSwitches(skip_topk=False), {}, True),
    "router_kernel_reference": (
        MetadataSwitches(), PagedSwitches(), {"route": "ref", "hash_route": "ref"}, True,
    ),
    "fused_mhc_off": (MetadataSwitches(), PagedSwitches(), {}, False),
    # (the compressor's ring-slot arithmetic runs inside its kernels now: no ring_offsets op
    # for this variant to switch)
    "glue_kernels_reference": (
        MetadataSwitches(), PagedSwitches(), {"norm_rope": "ref", "rope": "ref"}, True,
    ),
    # off by default until timed: this variant is the switch ON
    "fused_shared_expert_on": (MetadataSwitches(), PagedSwitches(fuse_shared_expert=True), {}, True),
    # issue 25's kernel variants, off by default until timed: these variants are the switch ON
    "attention_all_heads_on": (MetadataSwitches(), PagedSwitches(attention_all_heads=True), {}, True),
    "indexer_variants_on": (MetadataSwitches(), PagedSwitches(indexer_variants=True), {}, True),
    # metrics.routing_stats: an index_add_ per MoE layer (what counting expert popularity costs)
    "routing_stats_on": (MetadataSwitches(), PagedSwitches(), {}, True),
    "all_off": (
        MetadataSwitches(False, False, False), PagedSwitches(False, False),
        {"route": "ref", "hash_route": "ref"}, False,
    ),
}  # fmt: skip


def model_config(layers: str, experts: int, dry_run: bool, mtp: bool = False,
                 expert_weights: str = "bf16", linear_weights: str = "bf16") -> ModelConfig:  # fmt: skip
    """`expert_weights` "checkpoint": the routed experts are MXFP4 (V4-Flash's checkpoint format)
    and served so (`features.expert_weights`); `linear_weights` "checkpoint": the attention,
    shared-expert and MTP linears are FP8 with 128x128 block scales, served so
    (`features.linear_weights`)."""
    ratios = tuple(int(r) for r in layers.split(","))
    over = {"num_nextn_predict_layers": 1 if mtp else 0}
    if expert_weights == "checkpoint":
        over["expert_dtype"] = "fp4"
    if linear_weights == "checkpoint":
        over["linear_dtype"] = "fp8"
    if dry_run:
        return tiny_config().with_overrides(**over)
    return flash_config(len(ratios), ratios).with_overrides(n_routed_experts=experts, **over)


def build_model(cfg: ModelConfig, dry_run: bool, seed: int = 0, expert_weights: str = "bf16",
                linear_weights: str = "bf16"):  # fmt: skip
    device = "cpu" if dry_run else "cuda"
    dtype = torch.bfloat16
    model = random_model(cfg, seed=seed, dtype=dtype, device=device, draw_on_device=not dry_run,
                         expert_weights=expert_weights, linear_weights=linear_weights)  # fmt: skip
    kernels = KernelBackendConfig(default="ref" if dry_run else "triton")
    model.use_hot_ops(hot_ops(kernels, device))  # the reference forward's hot ops, too
    return model, kernels


def build_core(model, kernels, *, max_model_len: int, max_seqs: int, budget: int,
               num_blocks: int, index_pattern: str = "", plan: str = "area",
               spec_tokens: int = 0, graphs=None):  # fmt: skip
    """`graphs`: a GraphOptions (the core captures its decode passes before it returns)."""
    dev = model.embed.weight.device
    fp8 = dev.type == "cuda"
    options = CacheOptions(block_size=256, kv_dtype="fp8" if fp8 else "bf16",
                           index_dtype="mxfp4" if fp8 else "bf16", index_pattern=index_pattern,
                           num_speculative_tokens=spec_tokens)  # fmt: skip
    sched = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                            max_model_len=max_model_len, prefill_chunk_plan=plan,
                            num_speculative_tokens=spec_tokens)  # fmt: skip
    return build_engine_core(model, EngineOptions(options, sched, num_blocks, str(dev), kernels,
                                                  PagedOptions(graphs=graphs)))  # fmt: skip


def variant(core, name: str) -> PagedForward:
    """A paged forward over `core`'s cache with switch `name` at its baseline."""
    metadata, switches, overrides, _ = VARIANTS[name]
    base = core.runner.forward.paged.kernels
    kernels = dataclasses.replace(base, overrides={**base.overrides, **overrides})
    forward = PagedForward(
        core.runner.forward.paged.model, core.runner.cache, kernels, metadata, switches
    )
    if name == "routing_stats_on":
        forward.routing_stats = RoutingStats.for_model(forward.model, core.runner.cache.num_blocks)
    return forward


def fused_first(name: str) -> bool:
    return VARIANTS[name][3]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int, warmup: int) -> float:
    """Median wall time (ms) of fn() with a device sync around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def param_bytes(model) -> tuple[int, int]:
    """(bytes of every non-routed-expert weight, bytes of one routed expert), as held (FP8
    linears: their e4m3 weights and scales)."""
    dense = expert = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            if name.startswith("layers.0.ffn.experts.0."):  # one expert of one layer
                expert += p.numel() * p.element_size()
        elif not name.startswith("embed."):
            dense += p.numel() * p.element_size()
    stacked = model.layers[0].ffn.stacked_experts
    if stacked is not None and stacked.is_quantized:  # experts held only as MXFP4 / FP8 storage
        expert = stacked.nbytes // model.cfg.n_routed_experts
    return dense, expert


def decode_floor_ms(model, batch: int, context: int, kv_entry_bytes: int) -> float:
    """The weight + KV read floor of one decode step at 4.3 TB/s: every dense weight once, the
    expected distinct routed experts of `batch` tokens per layer once, each token's KV rows."""
    cfg = model.cfg
    dense, expert = param_bytes(model)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    distinct = e * (1 - (1 - k / e) ** batch)
    kv_rows = 0
    for r in cfg.compress_ratios:
        kv_rows += cfg.sliding_window + (0 if not r else min(cfg.index_topk, context // 4)
                                         if r == 4 else context // 128)  # fmt: skip
    total = dense + cfg.num_hidden_layers * distinct * expert + batch * kv_rows * kv_entry_bytes
    return total / PEAK_BYTES_PER_S * 1e3


def prefill_flops(model, length: int) -> float:
    """Useful FLOPs of a lone prompt: 2 x active weights per token, sparse attention over
    window + top-k / C128 entries, the indexer over the visible keys of Full C4 layers."""
    cfg = model.cfg
    dense, expert = param_bytes(model)
    active = (dense + cfg.num_hidden_layers * (cfg.num_experts_per_tok * expert)) / 2  # params
    flops = 2 * active * length
    h, d = cfg.num_attention_heads, cfg.head_dim
    pattern = model.index_pattern
    for i, r in enumerate(cfg.compress_ratios):
        avg_vis = length / 2 / (r or 1)
        cand = cfg.sliding_window + (0 if not r else min(cfg.index_topk, avg_vis))
        flops += 4 * h * d * cand * length
        if r == 4 and not pattern.is_shared(i):
            flops += 2 * cfg.index_n_heads * cfg.index_head_dim * avg_vis * length
    return flops


def record(name, shape, time_ms, baseline, baseline_ms, pct) -> dict:
    print(f"{name:22s} {shape:60s} {time_ms:9.3f} ms  base {baseline_ms:9.3f} ms "
          f"x{baseline_ms / time_ms:6.2f}  {pct:5.1f}%  [{baseline}]", flush=True)  # fmt: skip
    return {
        "name": name, "shape": shape, "time_us": round(time_ms * 1e3, 1), "baseline": baseline,
        "baseline_time_us": round(baseline_ms * 1e3, 1),
        "speedup": round(baseline_ms / time_ms, 3), "pct_roofline": round(pct, 2),
    }  # fmt: skip


def switch_records(record_name: str, shape: str, times: dict, tokens: dict, *, on_ms: float,
                   token_ref: str, skip: tuple[str, ...], floor_ms: float) -> list[dict]:  # fmt: skip
    """One record per variant (its time as the baseline of `on_ms`) with the share of its
    greedy tokens equal to `token_ref`'s; prints every variant."""
    out = []
    ref = tokens[token_ref]
    for name, t in times.items():
        same = sum(x == y for x, y in zip(tokens[name], ref)) / len(ref)
        print(f"  {name:36s} {t:9.3f} ms  tokens equal to {token_ref}: {same:.0%}")
        if name not in skip:
            rec = record(record_name, f"{shape},switch={name}", on_ms, f"{name} (baseline)", t,
                         100 * floor_ms / on_ms)  # fmt: skip
            rec["tokens_equal"] = same
            out.append(rec)
    return out


def end_decode_step(core, batch, rids) -> None:
    """Hand the timed step back to the scheduler (one token each) and finish the requests."""
    from dsv4.scheduler.batch import RequestStepOutput, StepOutput

    core.scheduler.update(StepOutput(tuple(RequestStepOutput(r.request_id, (2,))
                                           for r in batch.requests)))  # fmt: skip
    for rid in rids:
        core.abort(rid)
    while core.has_work():
        core.step()


def prefill_all(core, gen, vocab, batch, context, tag) -> list[str]:
    """Admit `batch` random prompts of `context` tokens; step until each has its first token."""
    rids = [f"{tag}-{i}" for i in range(batch)]
    for rid in rids:
        prompt = tuple(torch.randint(2, vocab, (context,), generator=gen).tolist())
        core.add_request(Request(rid, prompt, max_new_tokens=64, eos_token_id=None))
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in core.step() if o.new_token_ids)
    return rids
