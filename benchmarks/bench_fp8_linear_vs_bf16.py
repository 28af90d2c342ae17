"""FP8 linears against bf16 on one GPU, weights rotated past L2 (issue 21's fp8_linear_vs_bf16).

    python -m benchmarks.bench_fp8_linear_vs_bf16 --out results/kernels-fp8-linear-vs-bf16-h200.json
    python -m benchmarks.bench_fp8_linear_vs_bf16 --dry-run --out /tmp/f.json   # CPU: tiny, refs

Every V4-Flash linear stored as FP8 (benchmarks/bench_kernels_linear.py's shapes, wo_a grouped) at
1, 16, 64, 1024 and 8192 rows (and 2, 4 for the GEMV): cuBLAS on the dequantised bf16 weight
against each FP8 path on the same x, in one process. Each side is timed as one CUDA graph
that calls it on C copies of its weight in turn (C x weight bytes > 2x the H200's 60 MB L2, as
a decode step reads every layer's weights once), R times over; time = graph replay / (C x R),
median of 5 replays. Paths (`_paths`): "exact" (the served default of
`linear_weights=checkpoint`: the GEMV up to GEMV_MAX_ROWS, dequantise + cuBLAS above),
"fp8_switch" (`activations="fp8"` as served), "w8a8" (x quantised per 1x128 group, FP8 x FP8
MMA, the quantise included, at every row count from 16), "gemv" (1-row alternative configs).
Records: {"name": "fp8_linear_vs_bf16", "linear", "rows", "bf16_us", "fp8_us", "speedup",
"pct_roofline" (FP8 weight + scales + x + y bytes / time / 4.3 TB/s, or FLOP/s / 790
TFLOP/s (bf16 peak; FP8's is ~2x), the larger), "path", "config", "max_abs_err",
"rel_err" (||y - y_exact|| / ||y_exact||, y_exact: the dequantise path)}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.bench_kernels_linear import GPU_SIZES
from benchmarks.harness import PEAK_BYTES_PER_S, PEAK_FLOPS, warm_up_clocks
from dsv4.ops.quant import fp8_block_dequantize, fp8_block_quantize
from kernels.fp8_linear import (
    fp8_grouped_linear,
    fp8_grouped_linear_ref,
    fp8_linear,
    fp8_linear_ref,
)

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "kernels-fp8-linear-vs-bf16-h200.json"
ROWS = [1, 2, 4, 16, 64, 1024, 8192]
DRY = {"rows": [1, 16], "linears": {"wq_a": (256, 512)}, "groups": (2, 128, 256)}
L2_ROTATE_BYTES = 160e6  # > 2x the H200's 60 MB L2
# configs per path (each over the served config; `{}` = the served one)
GEMV_TUNES = ({"BLOCK_N": 32}, {"BLOCK_N": 32, "num_warps": 8}, {"BLOCK_K": 2048})


def _time_rotated(fn, arg_sets, rows: int, dry: bool) -> float:
    """µs per call of fn(*args) over the rotated `arg_sets` (one CUDA graph, median replay)."""
    if dry:
        start = time.perf_counter()
        fn(*arg_sets[0])
        return (time.perf_counter() - start) * 1e6
    reps = max(1, 192 // len(arg_sets)) if rows <= 64 else 1
    for args in arg_sets[:2]:  # compile and warm up outside the capture
        fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for args in arg_sets:
                fn(*args)
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (reps * len(arg_sets)))
    del graph
    return sorted(times)[len(times) // 2]


def _errors(y: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    d = (y.float() - exact.float()).flatten()
    return d.abs().max().item(), (d.norm() / exact.float().norm().clamp_min(1e-30)).item()


def _cases(sizes: dict, rows_list: list[int]):
    """(linear name, groups, N, K) for every stored-FP8 linear; wo_a with its 8 groups."""
    for name, (n, k) in sizes["linears"].items():
        yield name, 1, n, k
    g, n, k = sizes["groups"]
    yield "wo_a", g, n, k


def _paths(rows: int) -> list[tuple[str, dict]]:
    """(path, tune) at `rows`: "exact" (linear_weights=checkpoint's default), "fp8_switch" (the
    W8A8 switch as served: GEMV, W8A8 up to W8A8_MAX_ROWS, dequantise above), "w8a8" forced at
    every row count from 16, and the 1-row GEMV's alternative configs."""
    paths = [("exact", {}), ("fp8_switch", {})]
    if rows == 1:
        paths += [("gemv", {"GEMV": True, **t}) for t in GEMV_TUNES]
    if rows >= 16:
        paths.append(("w8a8", {"GEMV": False, "W8A8": True}))
    return paths


def run(dry: bool, deadline_s: float, out: Path) -> list[dict]:
    dev = "cpu" if dry else "cuda"
    sizes = DRY if dry else GPU_SIZES
    rows_list = DRY["rows"] if dry else ROWS
    torch.manual_seed(0)
    if not dry:
        warm_up_clocks()
    t0, records = time.monotonic(), []
    for name, groups, n, k in _cases(sizes, rows_list):
        w = torch.randn(groups * n, k, device=dev) / k**0.5
        codes, scale = fp8_block_quantize(w)
        del w
        dense = fp8_block_dequantize(codes, scale, 128, torch.bfloat16)
        copies = 1 if dry else int(min(48, max(2, -(-L2_ROTATE_BYTES // codes.numel()))))
        fp8_sets = [(codes.clone(), scale.clone()) for _ in range(copies)]
        bf16_sets = [dense.clone() for _ in range(copies)]
        for rows in rows_list:
            if time.monotonic() - t0 > deadline_s:
                print(f"deadline: stopped before {name} rows={rows}", flush=True)
                return records
            if groups > 1 and rows in (2, 4):
                continue
            shape = (rows, groups, k) if groups > 1 else (rows, k)
            x = torch.randn(shape, device=dev).to(torch.bfloat16)
            if groups > 1:

                def bf16(d, x=x, shape=(groups, n, k)):  # the model's grouped product
                    return torch.einsum("tgk,gnk->tgn", x, d.view(shape))

                def fp8(c, s, tune, act, x=x):
                    return fp8_grouped_linear(x, c, s, act, tune=tune)
            else:

                def bf16(d, x=x):
                    return F.linear(x, d)

                def fp8(c, s, tune, act, x=x):
                    return fp8_linear(x, c, s, act, tune=tune)

            bf16_us = _time_rotated(bf16, [(d,) for d in bf16_sets], rows, dry)
            exact = bf16(dense)
            nbytes = codes.numel() + scale.numel() + 2 * rows * groups * (n + k)
            flops = 2.0 * rows * groups * n * k
            for path, tune in _paths(rows):
                act = "bf16" if path in ("exact", "gemv") else "fp8"
                ref = fp8_grouped_linear_ref if groups > 1 else fp8_linear_ref
                if dry:  # the references stand in for the kernels
                    call = lambda c, s, a=act, r=ref, x=x: r(x, c, s, a)  # noqa: E731
                else:
                    call = lambda c, s, t=tune, a=act: fp8(c, s, t, a)  # noqa: E731
                try:
                    fp8_us = _time_rotated(call, fp8_sets, rows, dry)
                    y = call(codes, scale).view(exact.shape)
                except Exception as exc:  # a config that fails to build: say so, go on
                    print(f"{name} rows={rows} {path} {tune}: {type(exc).__name__}: "
                          f"{str(exc)[:200]}", flush=True)  # fmt: skip
                    continue
                max_err, rel_err = _errors(y, exact)
                pct = 100 * max(nbytes / (fp8_us * 1e-6) / PEAK_BYTES_PER_S,
                                flops / (fp8_us * 1e-6) / PEAK_FLOPS)  # fmt: skip
                cfg = {key: v for key, v in tune.items() if key not in ("GEMV", "W8A8")}
                records.append({
                    "name": "fp8_linear_vs_bf16", "linear": name, "rows": rows,
                    "bf16_us": round(bf16_us, 3), "fp8_us": round(fp8_us, 3),
                    "speedup": round(bf16_us / fp8_us, 3), "pct_roofline": round(pct, 1),
                    "path": path, "config": cfg or "served", "max_abs_err": round(max_err, 5),
                    "rel_err": round(rel_err, 6), "copies": copies,
                })  # fmt: skip
                print(f"{name:9s} T={rows:5d} {path:5s} {json.dumps(cfg):44s} bf16 {bf16_us:9.2f}"
                      f" fp8 {fp8_us:9.2f} x{bf16_us / fp8_us:5.2f} {pct:5.1f}% "
                      f"err {max_err:.4f} rel {rel_err:.2e}", flush=True)  # fmt: skip
            out.write_text(json.dumps(records, indent=1) + "\n")  # partial results survive
        del fp8_sets, bf16_sets, codes, scale, dense
        if not dry:
            torch.cuda.empty_cache()
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, references")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--deadline-s", type=float, default=300.0, help="stop starting cases")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --dry-run)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    records = run(args.dry_run, args.deadline_s, args.out)
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {len(records)} records to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
