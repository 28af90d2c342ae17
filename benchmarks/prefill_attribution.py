"""Where a fresh prompt's prefill step spends its time (issues 25 and 22): kernel time per
component, launch gaps, launches and host syncs of ONE prefill step, before prefill graphs.

    python -m benchmarks.prefill_attribution --out benchmarks/results/prefill-attribution-h200.json
    python -m benchmarks.prefill_attribution --prompt-len 1024,8192 --formats checkpoint --out ...
    python -m benchmarks.prefill_attribution --dry-run --out /tmp/pattr.json   # CPU smoke
    PARTS=pattr bash benchmarks/h200_session.sh                                 # device call

Engine: built by `build_worker_runtime` from the service flags `benchmarks/bench_e2e.py` gives
its workers (4-layer V4-Flash slice, 256 routed experts, random weights drawn on the GPU, no
MTP layer; `--role prefill`: the disaggregated P worker whose TTFT issue 25 measures). Formats:
`bf16` = bf16 experts + bf16 linears, `checkpoint` = MXFP4 experts + FP8 linears, one after the
other in this process (the first runtime is dropped before the second is built: both would not
fit next to each other). `--warm-up powers` by default: the measured lengths get warm-up steps
of their own here, the worker's other size classes would only cost device time.

Step: a fresh random prompt is admitted and scheduled once; `runner.execute` of that batch
(step metadata, the paged forward, first-token sampling, the host read of the token) is the
step timed: median wall of `--repeats`, after `--warmup` runs. It rewrites the same KV rows each
time. `attribution.attribute` splits its kernel time by component (gaps = wall - kernels:
launch gaps and host work the GPU waits for), `attribution.launches_and_syncs` counts GPU
kernels, host syncs (by call) and device-to-host copies per step. `core_step_us`: the served
step around it (`EngineCore.step` of a fresh prompt: schedule, execute, update). On the CPU
(`--dry-run`, tiny model) the GPU fields are null.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks import engine_setup as es
from benchmarks.attribution import attribute, launches_and_syncs
from dsv4.commands.service_args import service_config
from dsv4.model.tiny import write_model_spec
from dsv4.scheduler.batch import RequestStepOutput, StepOutput
from dsv4.scheduler.request import Request
from dsv4.worker.build import build_worker_runtime

FORMATS = {"bf16": "experts=bf16,linears=bf16", "checkpoint": "experts=mxfp4,linears=fp8"}
GPU_FIELDS = ("kernels_us", "gaps_us", "launches", "host_syncs", "dtoh_copies", "sync_calls",
              "components_us", "top_kernels", "gap_timeline")  # fmt: skip


def build_runtime(args, fmt: str, work: Path):
    """The worker's runtime for format `fmt` (`bf16` | `checkpoint` for experts and linears)."""
    cfg = es.model_config(args.layers, args.experts, args.dry_run, expert_weights=fmt,
                          linear_weights=fmt)  # fmt: skip
    spec = write_model_spec(work / fmt, cfg)
    # bench_e2e's worker flags; --forward paged: what "auto" picks on CUDA, on the CPU too
    flags = ("--model", f"random:{spec}", "--device", "cpu" if args.dry_run else "cuda",
             "--max-model-len", str(args.max_model_len), "--max-num-seqs", "64",
             "--num-blocks", str(args.num_blocks), "--max-num-batched-tokens", str(args.budget),
             "--expert-weights", fmt, "--linear-weights", fmt, "--role", args.role,
             "--warm-up", args.warm_up, "--log-level", "warning",
             "--forward", "paged")  # fmt: skip
    return build_worker_runtime(service_config(flags, {}), with_transport=False, name=fmt)


def _prompt(gen: torch.Generator, vocab: int, length: int) -> tuple[int, ...]:
    return tuple(torch.randint(2, vocab, (length,), generator=gen).tolist())


def core_step_us(core, gen, vocab: int, length: int, args, dev) -> float:
    """Median wall of `EngineCore.step` admitting a fresh prompt (a new one each time, so no
    cached prefix), as the role serves it; its blocks are handed back untimed."""
    prefill_only = args.role == "prefill"
    times = []
    for i in range(args.warmup + args.repeats):
        rid = f"core-{length}-{i}"
        core.add_request(Request(rid, _prompt(gen, vocab, length), max_new_tokens=1,
                                 eos_token_id=None), prefill_only=prefill_only)  # fmt: skip
        es.sync(dev)
        start = time.perf_counter()
        outputs = core.step()
        es.sync(dev)
        times.append((time.perf_counter() - start) * 1e6)
        assert [o.new_token_ids for o in outputs if o.request_id == rid], "no first token"
        core.release_hold(rid)
        while core.has_work():
            core.step()
    timed = sorted(times[args.warmup :])
    return timed[len(timed) // 2]


def measure(runtime, fmt: str, length: int, args) -> dict:
    core = runtime.engine.core
    cfg = runtime.model_config  # the tiny model's on a dry run
    runner, vocab = core.runner, cfg.vocab_size
    dev = torch.device("cpu" if args.dry_run else "cuda")
    gen = torch.Generator().manual_seed(length)
    rid = f"pattr-{length}"
    core.add_request(Request(rid, _prompt(gen, vocab, length), max_new_tokens=1,
                             eos_token_id=None))  # fmt: skip
    batch = core.scheduler.schedule()
    (only,) = batch.requests
    assert only.is_prefill and only.num_tokens == length and only.samples_token, (
        f"a {length}-token prompt is not one prefill step (budget {args.budget})"
    )
    step = lambda: runner.execute(batch)  # noqa: E731 (the step the profiler repeats)
    wall_ms = es.timed(step, dev, args.repeats, args.warmup)
    found = attribute(step, dev, repeats=args.repeats, top=15)
    counts = launches_and_syncs(step, dev)
    # hand the step back (its one token ends the request), then check nothing leaked
    core.scheduler.update(StepOutput((RequestStepOutput(rid, (2,)),)))
    core.abort(rid)
    while core.has_work():
        core.step()
    served = core_step_us(core, gen, vocab, length, args, dev)
    leaks = core.find_leaks()
    assert not leaks, leaks
    wall = round(wall_ms * 1e3, 1)
    rec = {"name": "prefill_attribution", "prompt_len": length, "formats": FORMATS[fmt],
           "role": args.role, "wall_us": wall,
           "core_step_us": round(served, 1), **dict.fromkeys(GPU_FIELDS), **counts,
           "card": args.card, "date": args.date, "experts": cfg.n_routed_experts,
           "layers": ",".join(map(str, cfg.compress_ratios))}  # fmt: skip
    if found:
        rec.update(kernels_us=found["kernels_us"], components_us=found["components_us"],
                   top_kernels=found["top_kernels"], profiled_wall_us=found["wall_us"],
                   gaps_us=round(wall - found["kernels_us"], 1))  # fmt: skip
    return rec


def summary(rec: dict) -> str:
    """A human table: the step's numbers, then component -> us (share of wall), top kernels."""
    head = (f"prefill {rec['prompt_len']} tokens, {rec['formats']}, {rec['role']}: wall "
            f"{rec['wall_us']} us (served step {rec['core_step_us']} us), kernels "
            f"{rec['kernels_us']} us, gaps {rec['gaps_us']} us, launches {rec['launches']}, "
            f"host syncs {rec['host_syncs']} {rec['sync_calls'] or ''}")  # fmt: skip
    lines = [head]
    comps = sorted((rec["components_us"] or {}).items(), key=lambda kv: -kv[1])
    for name, us in comps:
        lines.append(f"  {name:20s} {us:10.1f} us  {100 * us / rec['wall_us']:5.1f}%")
    for name, us in rec["top_kernels"] or ():
        lines.append(f"    {us:10.1f} us  {name}")
    if gaps := rec.get("gap_timeline"):
        lines.append(f"  idle: lead {gaps['lead_us']} us, between ops {gaps['between_us']} us "
                     f"({gaps['gaps_over_min']} gaps >= 5 us), tail {gaps['tail_us']} us")  # fmt: skip
        for before, after, us in gaps["top_gaps"]:
            lines.append(f"    {us:10.1f} us  {before} -> {after}")
    return "\n".join(lines)


def run_format(args, fmt: str, work: Path) -> None:
    runtime = None
    try:
        runtime = build_runtime(args, fmt, work)
        for length in args.lengths:
            rec = measure(runtime, fmt, length, args)
            args.records.append(rec)
            print(summary(rec), flush=True)
            save(args)
    except Exception as exc:  # a failing format (e.g. out of memory) is a result too
        traceback.print_exc()
        args.records.append({"name": "prefill_attribution", "formats": FORMATS[fmt],
                             "card": args.card, "date": args.date,
                             "error": repr(exc)[-1500:]})  # fmt: skip
        save(args)
    finally:
        del runtime  # the next format's weights need this one's memory
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def save(args) -> None:
    """Records so far (a device call may end before the benchmark does)."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(args.records, indent=1) + "\n")


def card_name() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    return next((c for c in ("h200", "h100") if c in name.lower()), name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model, null GPU fields")
    ap.add_argument("--prompt-len", default=None,
                    help="comma list, e.g. 1024,8192 (default 1024; dry run 16,40)")  # fmt: skip
    ap.add_argument("--formats", default="bf16,checkpoint",
                    help="bf16 (bf16 experts + linears), checkpoint (MXFP4 experts + FP8 "
                    "linears): comma list, run one after the other")  # fmt: skip
    ap.add_argument("--role", choices=("prefill", "colocated"), default="prefill")
    ap.add_argument("--warm-up", choices=("all", "powers"), default="powers")
    ap.add_argument("--layers", default="0,4,128,4")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=8704)  # bench_e2e's workers
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=16384, help="max_num_batched_tokens")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before each timing")
    args = ap.parse_args(argv)
    if args.dry_run:  # the tiny model's limits; few steps (the CPU runs the paged forward slowly)
        args.prompt_len = args.prompt_len or "16,40"
        args.max_model_len, args.num_blocks, args.budget = 512, 256, 512
        args.repeats, args.warmup = 1, 1
    elif not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --dry-run)")
    args.lengths = [int(n) for n in (args.prompt_len or "1024").split(",") if n]
    formats = [f for f in args.formats.split(",") if f]
    if unknown := set(formats) - set(FORMATS):
        ap.error(f"unknown formats {sorted(unknown)}: pick from {sorted(FORMATS)}")
    # a prompt is one step and fits the worker's model length (room for its one token)
    args.budget = max(args.budget, *args.lengths)
    args.max_model_len = max(args.max_model_len, max(args.lengths) + 8)
    args.card, args.date = card_name(), datetime.date.today().isoformat()
    args.records = []
    with tempfile.TemporaryDirectory(prefix="pattr-") as work:
        for fmt in formats:
            run_format(args, fmt, Path(work))
    save(args)
    print(f"wrote {len(args.records)} records to {args.out}")
    return 0 if all("error" not in r for r in args.records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
