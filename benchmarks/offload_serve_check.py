"""A worker with expert offload on one GPU (issue 22): the engine `dsv4 up` serves, built by
`build_worker_runtime` with `--device-memory-gib` / `--host-memory-gib`, on a `random:DIR`
V4-Flash-shaped model (MXFP4 experts, FP8 linears as stored).

    python -m benchmarks.offload_serve_check --out $OUT/offload_serve.json            # 4 layers
    python -m benchmarks.offload_serve_check --layers 43 --no-baseline --host-memory-gib 60
    python -m benchmarks.offload_serve_check --shape tiny --device cpu                # rehearsal

With a baseline (default): the same model without offload serves the same greedy prompts, and
the tokens must be equal (the offload changes where experts live, not the math). The device
budget is the plan's need minus `--offload-share` of the routed experts, so the plan offloads
about that share. Records load seconds, the plan's K / cache slots, prefill + decode seconds,
expert hit rate and bytes fetched; exit 1 on a token mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = ([5, 9, 200, 17, 33, 41, 7, 300, 12, 99, 4, 8], list(range(2, 150)))
GIB = 1 << 30


def overrides(model_dir: Path, device: str) -> dict:
    return {
        "model.path": f"random:{model_dir}", "model.device": device,
        "features.forward": "reference", "features.expert_weights": "checkpoint",
        "features.linear_weights": "checkpoint", "model.max_model_len": 512,
        "scheduler.max_num_batched_tokens": 128, "scheduler.max_num_seqs": 4,
        "cache.block_size": 256,
    }  # fmt: skip


def device_budget_gib(config, share: float) -> float:
    """The plan's device need minus `share` of the routed experts (so about that share is
    offloaded), in GiB of device memory."""
    from dsv4.worker.build import planned_model_config
    from dsv4.worker.fit import startup_plan

    plan = startup_plan(config, planned_model_config(config), 1 << 44)
    cut = share * plan.routed_expert_bytes
    return (plan.needed_bytes - cut + plan.request.runtime_reserve_gib * GIB) / (
        plan.request.memory_fraction * GIB
    )


def serve(values: dict, new_tokens: int) -> dict:
    import torch

    from benchmarks.runtime_tokens import runtime_greedy_tokens
    from dsv4.config import load_config, resolve_auto
    from dsv4.worker.build import build_worker_runtime

    config = load_config(values)
    start = time.perf_counter()
    runtime = build_worker_runtime(config, with_transport=False)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    tokens = runtime_greedy_tokens(runtime, PROMPTS, new_tokens)
    serve_s = time.perf_counter() - start
    record = {"load_and_warm_up_s": load_s, "serve_s": serve_s, "tokens": tokens}
    device = resolve_auto(config, has_cuda=torch.cuda.is_available(), hostname="", pid=0)
    if device.model.device.startswith("cuda"):
        record["max_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
    if runtime.offload is not None:
        used, stats = runtime.offload.offload, runtime.offload.stats()
        record.update(
            num_offloaded=used.num_offloaded, cache_slots=used.cache_slots,
            host_gib=sum(sum(b.nbytes for b in s.host.values()) for s in runtime.offload.stores)
            / GIB,
            hit_rate=stats.hit_rate, cache_hit_rate=stats.cache_hit_rate,
            misses=stats.misses, bytes_fetched=stats.bytes_fetched,
        )  # fmt: skip
    del runtime
    if device.model.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="flash", choices=("flash", "tiny"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--offload-share", type=float, default=0.4)
    parser.add_argument("--device-memory-gib", type=float, default=0.0, help="0: from the share")
    parser.add_argument("--host-memory-gib", type=float, default=64.0)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)

    from dsv4.config import load_config
    from dsv4.config.model import tiny_config
    from dsv4.model.tiny import write_model_spec
    from dsv4.plan import full_flash_config

    if args.shape == "flash":  # V4-Flash's first `layers` layers (+ its MTP layer)
        cfg = full_flash_config()
        cfg = cfg.with_overrides(num_hidden_layers=args.layers,
                                 compress_ratios=cfg.compress_ratios[: args.layers],
                                 num_hash_layers=min(cfg.num_hash_layers, args.layers))  # fmt: skip
    else:
        cfg = tiny_config().with_overrides(expert_dtype="fp4", linear_dtype="fp8")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_spec(Path(tmp), cfg)
        base = overrides(model_dir, args.device)
        budget = args.device_memory_gib or device_budget_gib(load_config(base), args.offload_share)
        offload = {**base, "model.device_memory_gib": budget,
                   "model.host_memory_gib": args.host_memory_gib}  # fmt: skip
        result = {"shape": args.shape, "layers": args.layers, "device_memory_gib": budget,
                  "offloaded": serve(offload, args.new_tokens)}  # fmt: skip
        if not args.no_baseline:
            result["baseline"] = serve(base, args.new_tokens)
            result["equal"] = result["baseline"]["tokens"] == result["offloaded"]["tokens"]
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if result.get("equal", True) else 1


if __name__ == "__main__":
    sys.exit(main())
