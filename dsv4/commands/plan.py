"""`dsv4 plan`: the per-GPU memory plan and its verdict, before anything is loaded.

    dsv4 plan --shape flash --gpus 1 --gpu-mem 141 --host-mem 512 --max-num-seqs 16
    dsv4 plan --model /ckpt/DeepSeek-V4-Pro --gpus 8 --gpu-mem 141 --json
    dsv4 plan --shape flash --gpu-mem 141 --host-mem 512 --routing-stats stats.json \
        --residency-out residency.json

With --routing-stats (a worker's `metrics.routing_stats_out` dump) the plan's E - K experts per
layer that stay on the device are the most selected ones; --residency-out writes that
residency file (dsv4.plan.residency) for the offload pool. A bad stats file is a one-line error.

Exit status: 0 when the plan fits (with or without expert offload, also when the offload's fetch
estimate is over --tpot-slo-ms: the verdict says so), 1 when it does not.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from dsv4.cache.packing import CacheOptions
from dsv4.config.model import ModelConfig
from dsv4.errors import ConfigError, UsageError
from dsv4.plan import MemoryPlan, PlanRequest, WeightFormats, plan_memory, shape_config
from dsv4.plan.residency import Residency, ResidencyError, read_residency, write_residency
from dsv4.plan.verdict import gib


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="per-GPU memory plan: fits / fits with expert offload / no")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="checkpoint dir (reads config.json only)")
    which.add_argument("--shape", choices=["flash", "pro"], help="full-depth V4-Flash or V4-Pro")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--gpu-mem", type=float, required=True, help="GiB per GPU")
    p.add_argument(
        "--host-mem", type=float, default=0.0, help="host RAM GiB per node (0: no offload)"
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=0,
        help="GPUs sharing one node's --host-mem (0: min(--gpus, 8))",
    )
    p.add_argument(
        "--tpot-slo-ms",
        type=float,
        default=50.0,
        help="flag an offload whose expert fetch per decode token exceeds this",
    )
    p.add_argument("--tp", type=int, default=0, help="tensor parallel size (0: --gpus)")
    p.add_argument("--ep", type=int, default=0, help="expert parallel size (0: --gpus)")
    p.add_argument("--max-model-len", type=int, default=65536)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--spec-tokens", type=int, default=0, help="MTP draft tokens (0: MTP off)")
    p.add_argument("--memory-fraction", type=float, default=0.9)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--kv-dtype", choices=["fp8", "bf16", "fp32"], default="fp8")
    p.add_argument("--index-dtype", choices=["mxfp4", "fp8", "bf16", "fp32"], default="mxfp4")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--cache-slots", type=int, default=0, help="cold-expert slots per layer")
    p.add_argument("--linear-format", choices=["checkpoint", "bf16"], default="checkpoint")
    p.add_argument("--expert-format", choices=["checkpoint", "bf16"], default="checkpoint")
    p.add_argument("--routing-stats", action="append", help="a worker's routing stats dump "
                   "(JSON): keep the most selected experts resident; once per worker to sum "
                   "several")  # fmt: skip
    p.add_argument("--residency-out", help="with --routing-stats: write the residency file here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=run_plan)


def request_from_args(args: argparse.Namespace) -> PlanRequest:
    cfg = ModelConfig.from_file(args.model) if args.model else shape_config(args.shape)
    return PlanRequest(
        model=cfg,
        num_gpus=args.gpus,
        gpu_mem_gib=args.gpu_mem,
        host_mem_gib=args.host_mem,
        gpus_per_node=args.gpus_per_node,
        tpot_slo_ms=args.tpot_slo_ms,
        tp=args.tp,
        ep=args.ep,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_speculative_tokens=args.spec_tokens,
        cuda_graphs=not args.no_cuda_graphs,
        memory_fraction=args.memory_fraction,
        cache_slots=args.cache_slots,
        formats=WeightFormats(args.linear_format, args.expert_format),
        cache=CacheOptions(args.block_size, args.kv_dtype, args.index_dtype),
    )


# PlanRequest's field (what ConfigError names) -> the flag a user of `dsv4 plan` typed.
_FLAGS = {
    "gpus": "--gpus",
    "gpu_mem_gib": "--gpu-mem",
    "host_mem_gib": "--host-mem",
    "gpus_per_node": "--gpus-per-node",
    "tpot_slo_ms": "--tpot-slo-ms",
    "tp/ep": "--tp/--ep",
    "tp": "--tp",
    "ep": "--ep",
}


def run_plan(args: argparse.Namespace) -> int:
    if args.residency_out and not args.routing_stats:
        raise UsageError("--residency-out: give --routing-stats too (the counts it comes from)")
    try:
        plan = plan_memory(request_from_args(args))
    except ConfigError as exc:
        if exc.field_name not in _FLAGS:
            raise
        raise UsageError(f"{_FLAGS[exc.field_name]} {exc.value}: {exc.fix}") from exc
    residency = plan_residency(plan, args.routing_stats) if args.routing_stats else None
    if residency is not None and args.residency_out and plan.fits:
        write_residency(residency, args.residency_out)
    out = plan_to_dict(plan)
    if residency is not None:
        out["residency"] = residency_summary(residency, args.residency_out if plan.fits else None)
    print(json.dumps(out, indent=1) if args.json else render(plan, out.get("residency")))
    return 0 if plan.fits else 1


def plan_residency(plan: MemoryPlan, stats_paths: list[str]) -> Residency:
    """The stats files (their counts summed), checked against the planned model, keeping the
    plan's E - K experts."""
    cfg = plan.request.model
    layers = cfg.num_hidden_layers + min(cfg.num_nextn_predict_layers, 1)  # the MTP layer last
    e = cfg.n_routed_experts
    counts = [[0] * e for _ in range(layers)]
    for path in stats_paths:
        try:
            stats = read_residency(path, layers, e)
        except ResidencyError as exc:
            raise UsageError(f"--routing-stats {exc.message}") from exc
        counts = [
            [a + b for a, b in zip(mine, theirs)] for mine, theirs in zip(counts, stats.counts)
        ]
    stats = Residency.from_counts(counts)
    k = plan.offloaded_per_layer if plan.fits else 0
    if k and plan.experts_per_layer != cfg.n_routed_experts:
        raise UsageError(f"--routing-stats: expert offload holds whole layers of experts "
                         f"({cfg.n_routed_experts}), this plan {plan.experts_per_layer} per GPU "
                         "(expert parallelism): plan with --ep 1")  # fmt: skip
    return stats.with_resident(cfg.n_routed_experts - k)


def residency_summary(residency: Residency, path: str | None) -> dict[str, Any]:
    return {
        "path": path,
        "num_resident": residency.num_resident,
        "num_experts": residency.num_experts,
        "resident_share": round(residency.resident_share(), 4),
    }


def plan_to_dict(plan: MemoryPlan) -> dict[str, Any]:
    req = plan.request
    return {
        "verdict": plan.verdict,
        "message": plan.message,
        "gpus": req.num_gpus,
        "gpu_mem_gib": req.gpu_mem_gib,
        "host_mem_gib": req.host_mem_gib,
        "gpus_per_node": req.gpus_per_node,
        "tpot_slo_ms": req.tpot_slo_ms,
        "fetch_ms_per_token": plan.fetch_ms_per_token,
        "tp": req.tp,
        "ep": req.ep,
        "max_model_len": req.max_model_len,
        "max_num_seqs": req.max_num_seqs,
        "num_speculative_tokens": req.num_speculative_tokens,
        "usable_bytes": plan.usable_bytes,
        "needed_bytes": plan.needed_bytes,
        "weight_bytes": plan.weight_bytes,
        "routed_expert_bytes": plan.routed_expert_bytes,
        "device_expert_bytes": plan.device_expert_bytes,
        "idle_device_bytes": plan.idle_device_bytes,  # the unused MTP layer (spec decoding off)
        "expert_bytes": plan.expert_bytes,
        "experts_per_layer": plan.experts_per_layer,
        "num_moe_layers": plan.num_moe_layers,
        "offloaded_per_layer": plan.offloaded_per_layer,
        "cache_slots": plan.cache_slots,
        "host_bytes": plan.host_bytes,
        "node_host_bytes": plan.node_host_bytes,
        "weights": [asdict(w) for w in plan.weights],
        "kv": {
            "bytes_per_request": plan.kv.bytes_per_request,
            "total_bytes": plan.kv.total_bytes,
            "block_stride_bytes": plan.kv.block_stride_bytes,
            "num_ring_blocks": plan.kv.num_ring_blocks,
            "kinds": [asdict(k) for k in plan.kv.kinds],
        },
        "buffers": [asdict(b) for b in plan.buffers],
    }


def render(plan: MemoryPlan, residency: dict[str, Any] | None = None) -> str:
    """A human table: weights by kind and format, KV per layer kind, buffers, the verdict (and
    the residency chosen from routing stats)."""
    rows = [f"{'weights (per GPU)':<34}{'per GPU':>14}{'whole model':>14}"]
    for w in plan.weights:
        name = f"{'mtp ' if w.is_mtp else ''}{w.kind} [{w.dtype}]"
        rows.append(f"  {name:<32}{gib(w.per_gpu_bytes):>14}{gib(w.total_bytes):>14}")
    rows.append(f"  {'total':<32}{gib(plan.weight_bytes):>14}")
    kv = plan.kv
    rows.append(
        f"KV cache: block {kv.block_size} tokens, stride {kv.block_stride_bytes} B,"
        f" {kv.num_ring_blocks} ring blocks/request"
    )
    for k in kv.kinds:
        rows.append(
            f"  {k.kind:<5} x{k.num_layers:<3} {k.paged_bytes_per_token:9.2f} B/token/layer"
            f"  ring {k.ring_bytes_per_request} B/request/layer"
        )
    rows.append(f"  per request {gib(kv.bytes_per_request)}, total {gib(kv.total_bytes)}")
    rows.append("buffers:")
    rows += [f"  {b.name:<18}{gib(b.nbytes):>12}  {b.formula}" for b in plan.buffers]
    rows.append(f"verdict: {plan.verdict}")
    rows.append(plan.message)
    if residency is not None:
        r = residency
        where = f"written to {r['path']}" if r["path"] else "not written (--residency-out)"
        if not plan.fits:
            where = "not written: the plan does not fit"
        rows.append(f"residency: {r['num_resident']} of {r['num_experts']} experts per layer "
                    f"resident, {100 * r['resident_share']:.1f}% of the counted selections; "
                    f"{where}")  # fmt: skip
    return "\n".join(rows)
