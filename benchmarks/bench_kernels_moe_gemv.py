"""MXFP4 grouped MoE against bf16 experts on one GPU: the decode GEMV (kernels/moe_gemv.py), the
in-register MMA kernel it replaces at decode sizes, and the served path at prefill sizes.

    python -m benchmarks.bench_kernels_moe_gemv --out results/moe-mxfp4-h200.json [--limit-s 330]
    python -m benchmarks.bench_kernels_moe_gemv --dry-run --out /tmp/g.json   # CPU: tiny shapes

V4-Flash experts (D 4096, I 2048, E 256, top-6), random routing. Every time is one CUDA graph of
ROTATE calls over ROTATE different routings of the same size, replayed, divided by ROTATE: each
call reads experts the previous one did not (at one token 8 x 80 MB of MXFP4 experts against a
50 MB L2), so no call finds its weights in L2. A, B and C run on the same inputs in one process.
Records (a JSON list):
- "moe_mxfp4_vs_bf16": {name, tokens, bf16_us, mxfp4_us, speedup (bf16 / MXFP4), pct_roofline
  (the MXFP4 bytes: weights and scales of the experts hit, x, y; at 4.3 TB/s), path (the served
  MXFP4 path at that size), mma_us (the in-register kernel; decode sizes), config};
- "moe_gemv_tune": each GEMV config tried at each decode size;
- "moe_gemv_threshold": the GEMV (BLOCK_M 2) against the in-register kernel at 128 and 256
  tokens, where the served choice switches;
- "moe_gemv_numerics": the layer output of the GEMV and of the in-register kernel against the
  exact dequantise-then-GEMM reference (`moe_experts_ref`): max abs error, relative L2 error,
  max error relative to the output's max.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.bench_kernels_moe import bf16_experts, moe_step, quantize_experts
from benchmarks.harness import PEAK_BYTES_PER_S, warm_up_clocks
from kernels import moe, moe_dequant, moe_gemv

GPU = dict(dim=4096, inter=2048, experts=256, k=6, decode=[1, 16, 64], prefill=[1024, 8192],
           between=[128, 256])  # fmt: skip
DRY = dict(dim=64, inter=32, experts=8, k=2, decode=[1, 3], prefill=[], between=[4])
ROTATE = 8
# GEMV configs tried at each decode size, each with POST_SCALE off and on, and BLOCK_M 1 and,
# from 16 tokens, 2 (the default config first)
CONFIGS = ({"BLOCK_N": 8, "BLOCK_N2": 16, "BLOCK_W": 64, "num_warps": 4},
           {"BLOCK_N": 8, "BLOCK_N2": 32, "BLOCK_W": 64, "num_warps": 4},
           {"BLOCK_N": 16, "BLOCK_N2": 32, "BLOCK_W": 64, "num_warps": 8},
           {"BLOCK_N": 4, "BLOCK_N2": 8, "BLOCK_W": 64, "num_warps": 2})  # fmt: skip


def _steps(sizes, t, weights, fmt, dev, count):
    """`count` steps of t tokens (moe_experts' arguments), their mean MXFP4-hit bytes."""
    steps = [moe_step(dev, sizes, t, weights, fmt) for _ in range(count)]
    return [s[0] for s in steps], sum(s[1] for s in steps) / count


def _time_us(fn, steps, dry: bool) -> float:
    """Median over replays of one graph of fn(*step) for every step, per call."""
    if dry:
        start = time.perf_counter()
        for step in steps:
            fn(*step)
        return (time.perf_counter() - start) / len(steps) * 1e6
    for step in steps:  # compile, warm
        fn(*step)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for step in steps:
            fn(*step)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(steps))
    return sorted(times)[len(times) // 2]


def _errors(y: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (y - ref).abs()
    return {"max_abs": d.max().item(), "rel_l2": (d.norm() / ref.norm()).item(),
            "max_rel_to_max": (d.max() / ref.abs().max()).item()}  # fmt: skip


def setup(dry: bool, gpu: dict, dry_sizes: dict):
    """A MoE sweep's start: (start time, device, sizes, bf16 experts, their MXFP4 quantisation);
    seed 0, and on the GPU the clocks brought up first."""
    t0, dev = time.monotonic(), "cpu" if dry else "cuda"
    sizes = dry_sizes if dry else gpu
    torch.manual_seed(0)
    if not dry:
        warm_up_clocks()
    w_bf16 = bf16_experts(sizes, dev)
    return t0, dev, sizes, w_bf16, quantize_experts(*w_bf16, "mxfp4")


def run(dry: bool, limit_s: float) -> list[dict]:
    t0, dev, sizes, w_bf16, w_fp4 = setup(dry, GPU, DRY)
    records = []
    call = lambda tune: lambda *a: moe.moe_experts(*a, tune=tune)  # noqa: E731
    for t in sizes["decode"] + sizes["prefill"] + sizes["between"]:
        if time.monotonic() - t0 > limit_s:
            print(f"time limit: stopped before {t} tokens", flush=True)
            break
        count = 2 if dry or t > 64 else ROTATE
        fp4_steps, fp4_bytes = _steps(sizes, t, (*w_fp4,), "mxfp4", dev, count)
        bf16_steps = [(s[0], s[1], s[2], *w_bf16, "bf16", None, None, s[8]) for s in fp4_steps]
        bf16_us = _time_us(call(None), bf16_steps, dry)
        pairs, e = t * sizes["k"], sizes["experts"]
        rec = {"name": "moe_mxfp4_vs_bf16", "tokens": t, "bf16_us": round(bf16_us, 2)}
        if t in sizes["decode"]:
            mma_us = _time_us(call({"GEMV": False}), fp4_steps, dry)
            default = moe_gemv.gemv_config(pairs, e, not dry)
            tried = [default] + [{**c, "POST_SCALE": ps, "BLOCK_M": m} for c in CONFIGS
                                 for ps in (False, True) for m in (1, 2) if m == 1 or t >= 16]  # fmt: skip
            tried = [c for i, c in enumerate(tried) if c not in tried[:i]]
            timed = []
            for cfg in tried if not dry else tried[:2]:
                us = _time_us(call({"GEMV": True, **cfg}), fp4_steps, dry)
                records.append({"name": "moe_gemv_tune", "tokens": t, "config": cfg,
                                "time_us": round(us, 2), "default": cfg == default})  # fmt: skip
                print(f"T={t:5d} gemv {cfg} {us:9.2f} us", flush=True)
                timed.append((us, cfg))
            best_us, best = min(timed, key=lambda b: b[0])
            # served: the best config measured here (gemv_config's table is set from it)
            rec.update(mxfp4_us=round(best_us, 2), path="gemv", mma_us=round(mma_us, 2),
                       config=best, default_us=round(timed[0][0], 2))  # fmt: skip
            args = fp4_steps[0]
            ref = moe.moe_experts_ref(*args)
            for path, tune in (("gemv", {"GEMV": True, **best}), ("mma", {"GEMV": False})):
                y = moe.moe_experts(*args, tune=tune)
                records.append({"name": "moe_gemv_numerics", "tokens": t, "path": path,
                                **_errors(y, ref)})  # fmt: skip
        elif t in sizes["between"]:  # where the GEMV stops paying: it against the MMA kernel
            mma_us = _time_us(call({"GEMV": False}), fp4_steps, dry)
            cfg = {**moe_gemv.gemv_config(pairs, e, not dry), "BLOCK_M": 2}
            us = _time_us(call({"GEMV": True, **cfg}), fp4_steps, dry)
            records.append({"name": "moe_gemv_threshold", "tokens": t, "gemv_us": round(us, 2),
                            "mma_us": round(mma_us, 2), "bf16_us": round(bf16_us, 2),
                            "config": cfg})  # fmt: skip
            print(json.dumps(records[-1]), flush=True)
            continue
        else:
            us = _time_us(call(None), fp4_steps, dry)
            path = "dequant" if moe_dequant.use_dequant(pairs, e, "mxfp4", not dry) else "mma"
            rec.update(mxfp4_us=round(us, 2), path=path)
        rec["speedup"] = round(bf16_us / rec["mxfp4_us"], 3)
        rec["pct_roofline"] = round(
            fp4_bytes / (rec["mxfp4_us"] * 1e-6) / PEAK_BYTES_PER_S * 100, 1
        )
        records.append(rec)
        print(json.dumps(rec), flush=True)
    return records


def table(records: list[dict]) -> str:
    lines = ["| tokens | bf16 | MXFP4 served | path | speedup | % roofline | in-register MMA |",
             "|---:|---:|---:|---|---:|---:|---:|"]  # fmt: skip
    for r in records:
        if r["name"] == "moe_mxfp4_vs_bf16":
            mma = f"{r['mma_us']:.1f} us" if "mma_us" in r else "-"
            lines.append(f"| {r['tokens']} | {r['bf16_us']:.1f} us | {r['mxfp4_us']:.1f} us | "
                         f"{r['path']} | {r['speedup']:.2f}x | {r['pct_roofline']:.0f} | {mma} |")  # fmt: skip
    return "\n".join(lines)


def cli(argv, description: str, run_fn, table_fn, numerics: str, limit_s: float) -> int:
    """The MoE sweeps' command line: --dry-run, --out, --limit-s; writes the records, prints the
    `numerics` records and the table."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--limit-s", type=float, default=limit_s, help="start no size after this")
    args = parser.parse_args(argv)
    records = run_fn(args.dry_run, args.limit_s)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    for r in records:
        if r["name"] == numerics:
            print(json.dumps(r))
    print(table_fn(records))
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli(argv, __doc__.split("\n")[0], run, table, "moe_gemv_numerics", 330.0)


if __name__ == "__main__":
    raise SystemExit(main())
