"""`dsv4 plan`: the per-GPU memory plan and its verdict, before anything is loaded.

    dsv4 plan --shape flash --gpu-mem 141 --host-mem 128
    dsv4 plan --model /ckpt/DeepSeek-V4-Pro --gpus 8 --gpu-mem 141 --json
    dsv4 plan --config worker.yaml --model /ckpt/DeepSeek-V4-Flash --gpu-mem 141
    dsv4 plan --shape flash --gpu-mem 141 --host-mem 512 --routing-stats stats.json \
        --residency-out residency.json

By default it asks the question a worker's start-up asks (`dsv4.worker.fit`): the flags that
are worker settings (`--host-mem` = `--host-memory-gib`, `--max-model-len`, `--expert-format` =
`--expert-weights`, ...) build the worker's ServeConfig, with the worker's defaults, over
`--config` YAML and DSV4_* variables as the worker layers them, resolved as on a CUDA card of
`--gpu-mem` GiB; its request is `startup_request`'s (the captured decode batch shrunk as the
worker's `fit_graph_batch` does when experts are offloaded). So `dsv4 plan --shape flash
--gpu-mem 141 --host-mem 128` and `dsv4 up --host-memory-gib 128` of V4-Flash on a 141 GiB
card give one verdict, one K and the same cache slots. What only the plan asks on top:
`--gpus/--tp/--ep/--gpus-per-node` (a layout of several GPUs and nodes, `--host-mem` per node),
`--max-num-seqs` given (KV for that many full-length requests, where the worker checks one),
`--cache-slots`, `--host-mem-fraction`, `--tpot-slo-ms`, `--h2d-gbps`.

With --routing-stats (a worker's `metrics.routing_stats_out` dump) the plan's E - K experts per
layer that stay on the device are the most selected ones; --residency-out writes that
residency file (dsv4.plan.residency) for the offload pool. A bad stats file is a one-line error.

Exit status: 0 when the plan fits (with or without expert offload, also when the offload's fetch
estimate is over --tpot-slo-ms: the verdict says so), 1 when it does not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from dsv4.config import ServeConfig, config_from_args
from dsv4.config.cli import CONFIG_PATH_DEST
from dsv4.config.load import CONFIG_PATH_ENV, SPECS
from dsv4.config.model import ModelConfig
from dsv4.config.resolve import resolve_auto
from dsv4.config.sections import MAX_MEMORY_GIB
from dsv4.errors import ConfigError, UsageError
from dsv4.plan import MemoryPlan, PlanRequest, plan_memory, shape_config
from dsv4.plan.residency import Residency, ResidencyError, read_residency, write_residency
from dsv4.plan.verdict import gib
from dsv4.worker.fit import (
    GIB,
    RequestEdit,
    planned_model_config,
    startup_config,
    startup_request,
)

_CHANGED = "default changed: was"
# The worker settings `dsv4 plan` takes: (flags, the first as the plan always named it, then
# the worker's own where it differs; its ServeConfig field; help where the plan's differs from
# the field's). Defaults, choices and checks are the field's.
_SETTINGS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("--host-mem", "--host-memory-gib"), "model.host_memory_gib",
     "pinned host memory (GiB) for offloaded experts, per node (its GPUs share it); 0: no "
     "offload (meaning changed: was host RAM, 80%% of it pinnable: --host-mem-fraction 0.8)"),
    (("--max-model-len",), "model.max_model_len",
     f"tokens of a request whose KV must fit; 0: the model's max_position_embeddings ({_CHANGED} "
     "65536)"),
    (("--max-num-seqs",), "scheduler.max_num_seqs",
     "requests running at once: the captured decode batch and the expert cache slots; given, "
     "KV for this many full-length requests must fit (the worker's start-up checks one)"),
    (("--max-num-batched-tokens",), "scheduler.max_num_batched_tokens", ""),
    (("--memory-fraction",), "cache.memory_fraction", ""),
    (("--block-size",), "cache.block_size", ""),
    (("--kv-dtype",), "cache.kv_dtype", f"KV entry format; auto: as the worker resolves it on a "
     f"CUDA card ({_CHANGED} fp8)"),
    (("--index-dtype", "--indexer-key-dtype"), "cache.indexer_key_dtype", ""),
    (("--cuda-graphs",), "features.cuda_graphs", ""),
    (("--cuda-graph-max-batch",), "features.cuda_graph_max_batch", ""),
    (("--forward",), "features.forward", ""),
    (("--dtype",), "model.dtype", ""),
    (("--expert-staging",), "features.expert_staging", ""),
    (("--linear-format", "--linear-weights"), "features.linear_weights",
     "linears as the worker holds them: bf16, checkpoint (FP8) or auto (checkpoint on a GPU, "
     "bf16 with several tensor-parallel ranks; the worker line shows which)"),
    (("--expert-format", "--expert-weights"), "features.expert_weights",
     "routed experts as the worker holds them: bf16, checkpoint (MXFP4/FP8) or auto (as "
     "--linear-format auto)"),
)  # fmt: skip


def _count(least: int, zero: str = "") -> Callable[[str], int]:
    """argparse type: an integer >= `least` (`zero` says what 0 means). A negative TP, EP or
    GPU count planned "fits" with negative bytes; refused here, as a usage error of the flag."""

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value}: give an integer >= {least}{zero}")
        return value

    return count


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="per-GPU memory plan: fits / fits with expert offload / no")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="checkpoint dir (reads config.json only), 'tiny' or "
                       "'random:DIR' as the worker's --model")  # fmt: skip
    which.add_argument("--shape", choices=["flash", "pro"], help="full-depth V4-Flash or V4-Pro")
    p.add_argument("--gpu-mem", type=float, required=True, help="GiB per GPU")
    p.add_argument(
        "--gpus", type=_count(1), default=None,
        help="GPUs of the layout (default: the worker's tensor_parallel_size, 1)",
    )  # fmt: skip
    p.add_argument(
        "--gpus-per-node",
        type=_count(0, " (0: min(--gpus, 8))"),
        default=0,
        help="GPUs sharing one node's --host-mem (0: min(--gpus, 8))",
    )
    p.add_argument("--tp", type=_count(0, " (0: --gpus)"), default=0,
                   help="tensor parallel size (0: --gpus)")  # fmt: skip
    p.add_argument("--ep", type=_count(0, " (0: --gpus)"), default=0, help="expert parallel size "
                   "(0: --gpus; a worker of T ranks has T with --expert-parallel, else 1)")  # fmt: skip
    p.add_argument(
        "--host-mem-fraction", type=float, default=1.0,
        help="share of --host-mem that may be pinned (default 1: --host-mem is the pinned "
        f"budget itself, as the worker's --host-memory-gib; {_CHANGED} 0.8)",
    )  # fmt: skip
    p.add_argument(
        "--tpot-slo-ms",
        type=float,
        default=50.0,
        help="flag an offload whose expert fetch per decode token exceeds this",
    )
    p.add_argument("--h2d-gbps", type=float, default=25.0, help="pinned host-to-device GB/s "
                   "for that fetch estimate (25: PCIe Gen4 x16; a Gen5 x16 host measures ~55)")  # fmt: skip
    p.add_argument("--spec-tokens", type=int, default=None, help="MTP draft tokens (0: MTP off; "
                   "default: as --config says, off)")  # fmt: skip
    p.add_argument("--cache-slots", type=_count(0, " (0: the worker's)"), default=0,
                   help="cold-expert slots per layer (0: the worker's, a captured decode step's "
                   f"tokens x top-k on the paged forward, top-k on the reference; {_CHANGED} "
                   "top-k)")  # fmt: skip
    p.add_argument("--config", dest=CONFIG_PATH_DEST, metavar="PATH", default=None,
                   help=f"the worker's YAML config (env {CONFIG_PATH_ENV}); layers: defaults < "
                   "YAML < env < flags")  # fmt: skip
    for flags, key, text in _SETTINGS:
        _add_setting(p, flags, key, text)
    p.add_argument("--routing-stats", action="append", help="a worker's routing stats dump "
                   "(JSON): keep the most selected experts resident; once per worker to sum "
                   "several")  # fmt: skip
    p.add_argument("--residency-out", help="with --routing-stats: write the residency file here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=run_plan)


def _add_setting(p: argparse.ArgumentParser, flags: tuple[str, ...], key: str, text: str) -> None:
    """One worker setting as `add_config_args` adds it (not given: the lower layers' value)."""
    spec = SPECS[key]
    help_text = f"{text or spec.help} [the worker's {spec.flag}; default {spec.default!r}]"
    kwargs: dict[str, Any] = {"dest": key, "default": argparse.SUPPRESS, "help": help_text}
    if spec.type is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif spec.choices:
        kwargs["choices"] = spec.choices
    else:
        kwargs["metavar"] = spec.type.__name__.upper()
    p.add_argument(*flags, **kwargs)


def worker_config(args: argparse.Namespace) -> tuple[ServeConfig, ModelConfig]:
    """(the worker's ServeConfig from the flags (over --config and DSV4_*), resolved as its
    start-up resolves it on a CUDA card (`dsv4.worker.build.build_worker_runtime`), the model's
    config: --model's or --shape's)."""
    forced: dict[str, Any] = {"model.path": args.model} if args.model is not None else {}
    if args.spec_tokens is not None:
        if args.spec_tokens < 0:
            raise UsageError(f"--spec-tokens {args.spec_tokens}: give 0 (MTP off) to 3")
        forced["speculative.method"] = "mtp" if args.spec_tokens else "none"
        if args.spec_tokens:
            forced["speculative.num_speculative_tokens"] = args.spec_tokens
    config = config_from_args(args, os.environ, forced=forced)
    model_cfg = planned_model_config(config) if args.model is not None else shape_config(args.shape)
    return resolve_auto(config, has_cuda=True, hostname="plan", pid=0, model=model_cfg), model_cfg


def plan_edit(args: argparse.Namespace, config: ServeConfig) -> RequestEdit:
    """What the plan asks beyond the worker's start-up (its docstring): the worker's request
    as it is unless those flags are given."""
    kv_requests = config.scheduler.max_num_seqs if "scheduler.max_num_seqs" in vars(args) else 0
    layout = args.gpus is not None or args.tp or args.ep or args.gpus_per_node

    def edit(req: PlanRequest) -> PlanRequest:
        if layout:
            gpus = req.num_gpus if args.gpus is None else args.gpus
            req = replace(req, num_gpus=gpus, tp=args.tp, ep=args.ep,
                          gpus_per_node=args.gpus_per_node)  # fmt: skip
        return replace(
            req,
            gpu_mem_gib=args.gpu_mem,
            host_mem_fraction=args.host_mem_fraction,
            tpot_slo_ms=args.tpot_slo_ms,
            h2d_gb_per_s=args.h2d_gbps,
            max_num_seqs=kv_requests or req.max_num_seqs,
            cache_slots=args.cache_slots or req.cache_slots,
        )

    return edit


def plan_from_args(args: argparse.Namespace) -> tuple[ServeConfig, MemoryPlan]:
    """(the worker's config as start-up plans it, the plan); raises ConfigError."""
    if not (math.isfinite(args.gpu_mem) and 0 < args.gpu_mem <= MAX_MEMORY_GIB):
        fix = f"give device memory in GiB, in (0, {MAX_MEMORY_GIB}]"
        raise ConfigError("gpu_mem_gib", args.gpu_mem, fix)
    if not 0 < args.host_mem_fraction <= 1:
        raise UsageError(f"--host-mem-fraction {args.host_mem_fraction}: give a share in (0, 1]")
    config, model_cfg = worker_config(args)
    total, edit = int(args.gpu_mem * GIB), plan_edit(args, config)
    config = startup_config(config, model_cfg, total, edit)
    return config, plan_memory(startup_request(config, model_cfg, total, edit))


def request_from_args(args: argparse.Namespace) -> PlanRequest:
    """The request `dsv4 plan` plans, resolved (the worker's start-up request, edited by
    `plan_edit`)."""
    return plan_from_args(args)[1].request


# PlanRequest's or ServeConfig's field (what ConfigError names) -> the flag the user typed.
_FLAGS = {
    "gpus": "--gpus",
    "gpu_mem_gib": "--gpu-mem",
    "host_mem_gib": "--host-mem",
    "gpus_per_node": "--gpus-per-node",
    "tpot_slo_ms": "--tpot-slo-ms",
    "h2d_gb_per_s": "--h2d-gbps",
    "tp/ep": "--tp/--ep",
    "tp": "--tp",
    "ep": "--ep",
    "speculative.num_speculative_tokens": "--spec-tokens",
    **{key: flags[0] for flags, key, _ in _SETTINGS},
}


def run_plan(args: argparse.Namespace) -> int:
    if args.residency_out and not args.routing_stats:
        raise UsageError("--residency-out: give --routing-stats too (the counts it comes from)")
    try:
        config, plan = plan_from_args(args)
    except ConfigError as exc:
        if exc.field_name not in _FLAGS or exc.env_var or exc.yaml_path:
            raise  # a setting the user gave no flag for: its message names the source
        raise UsageError(f"{_FLAGS[exc.field_name]} {exc.value}: {exc.fix}") from exc
    residency = plan_residency(plan, args.routing_stats) if args.routing_stats else None
    if residency is not None and args.residency_out and plan.fits:
        write_residency(residency, args.residency_out)
    out = plan_to_dict(plan, config)
    if residency is not None:
        out["residency"] = residency_summary(residency, args.residency_out if plan.fits else None)
    print(json.dumps(out, indent=1) if args.json else render(plan, out.get("residency"), config))
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


def worker_settings(config: ServeConfig) -> dict[str, Any]:
    """The worker settings the plan was made with (after `resolve_auto`, `fit_graph_batch`)."""
    f = config.features
    return {
        "forward": f.forward,
        "dtype": config.model.dtype,
        "linear_format": f.linear_weights,
        "expert_format": f.expert_weights,
        "kv_dtype": config.cache.kv_dtype,
        "cuda_graph_max_batch": f.cuda_graph_max_batch,  # as fit_graph_batch left it
        "expert_staging": f.expert_staging,
    }


def plan_to_dict(plan: MemoryPlan, config: ServeConfig | None = None) -> dict[str, Any]:
    req = plan.request
    return {
        "verdict": plan.verdict,
        "message": plan.message,
        "worker": worker_settings(config) if config is not None else None,
        "gpus": req.num_gpus,
        "gpu_mem_gib": req.gpu_mem_gib,
        "host_mem_gib": req.host_mem_gib,
        "gpus_per_node": req.gpus_per_node,
        "host_mem_fraction": req.host_mem_fraction,
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


def render(
    plan: MemoryPlan, residency: dict[str, Any] | None = None, config: ServeConfig | None = None
) -> str:
    """A human table: the worker settings, weights by kind and format, KV per layer kind,
    buffers, the verdict (and the residency chosen from routing stats)."""
    rows = []
    if config is not None:
        w = worker_settings(config)
        rows.append(f"worker: {w['forward']} forward, {w['dtype']}, linears {w['linear_format']},"
                    f" experts {w['expert_format']}, KV {w['kv_dtype']}, decode graphs up to batch"
                    f" {w['cuda_graph_max_batch']}; KV checked for {plan.request.max_num_seqs}"
                    f" request(s) of {plan.request.max_model_len} tokens")  # fmt: skip
    rows.append(f"{'weights (per GPU)':<34}{'per GPU':>14}{'whole model':>14}")
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
