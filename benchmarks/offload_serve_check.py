"""A worker with expert offload on one GPU (issue 22): the engine `dsv4 up` serves, built by
`build_worker_runtime` with `--device-memory-gib` / `--host-memory-gib`, on a `random:DIR`
V4-Flash-shaped model (MXFP4 experts, FP8 linears as stored).

    python -m benchmarks.offload_serve_check --out $OUT/offload_serve.json            # 4 layers
    python -m benchmarks.offload_serve_check --layers 43 --no-baseline --host-memory-gib 60
    python -m benchmarks.offload_serve_check --shape tiny --device cpu                # rehearsal
    python -m benchmarks.offload_serve_check --layers 43 --no-check --offload-share 0 \
        --runs paged --routings uniform --max-seqs 16 --out $OUT/full.json  # the card decides

Check: the offloaded worker on `--forward` (paged: the expert pool inside the decode graphs)
serves the greedy prompts; with a baseline (default) the same model without offload serves the
same ones and the tokens must be equal (exit 1 otherwise). The device budget is the plan's need
minus `--offload-share` of the routed experts, so the plan offloads about that share.

Timing (`records`, benchmarks/offload_timing.py): `full_depth_tpot` per batch and routing
(uniform, zipf1) for the paged forward with graphs (without and with `expert_prefetch`, field
`expert_prefetch`) and the reference forward, each offloaded,
`--mtp-k K` times them with MTP speculation (the TPOT per expected token),
and `full_depth_ttft` of a `--ttft-prompt`-token prompt, `full_depth_prefill` of a
`--prefill-prompt`-token one; see that module for the fields. `--offload-share 0` leaves the
device budget to the card (the plan offloads what does not fit); `--out` is rewritten after
each timed run, so a run cut off by a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = ([5, 9, 200, 17, 33, 41, 7, 300, 12, 99, 4, 8], list(range(2, 150)))
GIB = 1 << 30


def overrides(model_dir: Path, device: str, forward: str, max_seqs: int = 2,
              max_len: int = 512, step_tokens: int = 128, warm_up: str = "all") -> dict:  # fmt: skip
    return {
        "scheduler.warm_up": warm_up,
        "model.path": f"random:{model_dir}", "model.device": device,
        "features.forward": forward, "features.expert_weights": "checkpoint",
        "features.linear_weights": "checkpoint", "model.max_model_len": max_len,
        "scheduler.max_num_batched_tokens": step_tokens, "scheduler.max_num_seqs": max_seqs,
        # 512: the paged forward keeps each window ring in one block (a 4-layer slice at
        # 256 splits them: its blocks are smaller than the full model's)
        "cache.block_size": 512,
    }  # fmt: skip


def device_budget_gib(config, share: float) -> float:
    """The plan's device need minus `share` of the routed experts (so about that share is
    offloaded), in GiB of device memory; 0 (share 0 on a GPU): the card's own memory."""
    if share <= 0 and config.model.device.startswith("cuda"):
        return 0.0
    from dsv4.worker.build import planned_model_config
    from dsv4.worker.fit import startup_plan

    plan = startup_plan(config, planned_model_config(config), 1 << 44)
    cut = share * plan.routed_expert_bytes
    return (plan.needed_bytes - cut + plan.request.runtime_reserve_gib * GIB) / (
        plan.request.memory_fraction * GIB
    )


def release() -> None:
    """After the caller dropped its runtime: hand its device memory (and pinned host memory)
    back before the next one is built."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def offload_record(offload) -> dict:
    """The plan's K and slots, host bytes and the traffic counters of a served offload."""
    stats = offload.stats()
    if offload.pool is not None:
        host = sum(t.nbytes for layer in offload.pool.layers for t in layer.host)
    else:
        host = sum(sum(b.nbytes for b in s.host.values()) for s in offload.stores)
    return dict(num_offloaded=offload.offload.num_offloaded, cache_slots=offload.offload.cache_slots,
                host_gib=host / GIB, hit_rate=stats.hit_rate, cache_hit_rate=stats.cache_hit_rate,
                misses=stats.misses, bytes_fetched=stats.bytes_fetched)  # fmt: skip


def serve(values: dict, new_tokens: int) -> dict:
    import torch

    from benchmarks.runtime_tokens import runtime_greedy_tokens
    from dsv4.config import load_config
    from dsv4.worker.build import build_worker_runtime

    start = time.perf_counter()
    runtime = build_worker_runtime(load_config(values), with_transport=False)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    tokens = runtime_greedy_tokens(runtime, PROMPTS, new_tokens)
    serve_s = time.perf_counter() - start
    record = {"load_and_warm_up_s": load_s, "serve_s": serve_s, "tokens": tokens,
              "forward": runtime.config.features.forward}  # fmt: skip
    # progress on stderr as each run ends: a call that hits its time limit still says how far
    # it got (the JSON is written at the end)
    print(f"served ({'offloaded' if runtime.offload is not None else 'resident'}): load and "
          f"warm-up {load_s:.1f} s, {len(PROMPTS)} prompts {serve_s:.1f} s", file=sys.stderr,
          flush=True)  # fmt: skip
    if runtime.config.model.device.startswith("cuda"):
        record["max_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
    if runtime.offload is not None:
        record.update(offload_record(runtime.offload))
    del runtime
    release()
    return record


def model_config(shape: str, layers: int):
    from dsv4.config.model import tiny_config
    from dsv4.plan import full_flash_config

    if shape == "flash":  # V4-Flash's first `layers` layers (+ its MTP layer)
        cfg = full_flash_config()
        return cfg.with_overrides(num_hidden_layers=layers,
                                  compress_ratios=cfg.compress_ratios[:layers],
                                  num_hash_layers=min(cfg.num_hash_layers, layers))  # fmt: skip
    return tiny_config().with_overrides(expert_dtype="fp4", linear_dtype="fp8")


def _fraction(text: str) -> float:
    """--memory-fraction: a share of the device in (0, 1] (cache.memory_fraction's range),
    refused by argparse in one line."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a share of the device in (0, 1]")
    return value


def _at_least(low: int):
    """An argparse type: an integer >= `low`, refused in one line."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r}: give an integer >= {low}")
        return value

    return parse


def _batches(text: str) -> str:
    """--batches: a comma list of decode batches >= 1 (kept as text, as the runs read it)."""
    for part in text.split(","):
        _at_least(1)(part.strip())
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="flash", choices=("flash", "tiny"))
    parser.add_argument("--layers", type=_at_least(1), default=4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--forward", default="paged", choices=("paged", "reference"),
                        help="the token check's forward")  # fmt: skip
    parser.add_argument("--offload-share", type=float, default=0.4)
    parser.add_argument("--device-memory-gib", type=float, default=0.0, help="0: from the share")
    parser.add_argument("--host-memory-gib", type=float, default=64.0)
    parser.add_argument("--memory-fraction", type=_fraction, default=0.9,
                        help="cache.memory_fraction: the share of the device the plan may use")  # fmt: skip
    parser.add_argument("--new-tokens", type=_at_least(1), default=8)
    parser.add_argument("--no-baseline", action="store_true",
                        help="no resident token check, no reference-forward timing")  # fmt: skip
    parser.add_argument("--no-check", action="store_true",
                        help="no token check at all (offloaded or resident): timing only")  # fmt: skip
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument(
        "--no-prefetch",
        action="store_true",
        help="skip the timing runs with features.expert_prefetch",
    )
    parser.add_argument("--runs", default="",
                        help="timed runs, from paged,paged_prefetch,reference ('': all that the "
                             "--no-* flags leave)")  # fmt: skip
    parser.add_argument("--staging-experts", type=_at_least(0), default=32,
                        help="the staging runs' prefill buffer (features.expert_staging)")  # fmt: skip
    parser.add_argument("--max-seqs", type=_at_least(0), default=0,
                        help="the timed runtimes' max sequences (0: the largest batch)")  # fmt: skip
    parser.add_argument("--batches", type=_batches, default="1,16")
    parser.add_argument("--routings", default="uniform,zipf1")
    parser.add_argument(
        "--prompt-len", type=_at_least(1), default=64, help="the TPOT runs' prompts"
    )
    parser.add_argument("--steps", type=_at_least(1), default=16, help="timed decode steps")
    parser.add_argument("--ttft-prompt", type=_at_least(0), default=1024,
                        help="full_depth_ttft's prompt; 0: none")  # fmt: skip
    parser.add_argument("--warm-up", default="all", choices=("all", "powers"),
                        help="scheduler.warm_up of every runtime (powers: the measured prompt "
                             "lengths are powers of two or --prompt-len)")  # fmt: skip
    parser.add_argument("--prefill-prompt", type=_at_least(0), default=0,
                        help="full_depth_prefill's prompt (tok_s); 0: none")  # fmt: skip
    parser.add_argument("--mtp-k", type=int, default=0, choices=(0, 1, 2, 3),
                        help="timed runs speculate with the MTP layer, K drafts a step")  # fmt: skip
    parser.add_argument("--acceptance", default="0.837,0.672,0.573",
                        help="cumulative acceptance per draft position for the MTP TPOT: the "
                             "trained tiny model, greedy "
                             "(benchmarks/results/mtp-acceptance-trained-tiny.json)")  # fmt: skip
    parser.add_argument("--out", default="")
    return parser.parse_args(argv)


def save(result: dict, out: str) -> None:
    """`result` to `out` (when given): called after each run, so a cut-off call keeps them."""
    if out:
        Path(out).write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # the worker's start-up stages (weights, warm-up) in the log as they end
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")  # fmt: skip
    from dsv4.config import load_config
    from dsv4.model.tiny import write_model_spec

    cfg = model_config(args.shape, args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_spec(Path(tmp), cfg)
        base = overrides(model_dir, args.device, args.forward, warm_up=args.warm_up)
        budget = args.device_memory_gib or device_budget_gib(load_config(base), args.offload_share)
        offload = {**base, "model.device_memory_gib": budget,
                   "model.host_memory_gib": args.host_memory_gib,
                   "cache.memory_fraction": args.memory_fraction}  # fmt: skip
        result = {"shape": args.shape, "layers": args.layers, "device_memory_gib": budget,
                  "memory_fraction": args.memory_fraction}  # fmt: skip
        if not args.no_check:
            result["offloaded"] = serve(offload, args.new_tokens)
            save(result, args.out)
            if not args.no_baseline:
                result["baseline"] = serve(base, args.new_tokens)
                result["equal"] = result["baseline"]["tokens"] == result["offloaded"]["tokens"]
                save(result, args.out)
        if not args.no_timing:
            from benchmarks.offload_timing import timing_records

            result["records"] = timing_records(
                model_dir,
                args,
                on_run=lambda records: save({**result, "records": records}, args.out),
            )
    print(json.dumps(result, indent=1))
    save(result, args.out)
    return 0 if result.get("equal", True) else 1


if __name__ == "__main__":
    sys.exit(main())
