"""FP8 linears against bf16 on one GPU, weights rotated past L2 (issue 21's fp8_linear_vs_bf16).

    python -m benchmarks.bench_fp8_linear_vs_bf16 --out results/kernels-fp8-linear-vs-bf16-h200.json
    python -m benchmarks.bench_fp8_linear_vs_bf16 --dry-run --out /tmp/f.json   # CPU: tiny, refs
    python -m benchmarks.bench_fp8_linear_vs_bf16 --rows 1,16,64,1024,8192 \
        --paths exact,fp8_switch,w8a8,w8a8_cublas --out /tmp/f.json   # issue 21's W8A8 A/B

Every V4-Flash linear stored as FP8 (benchmarks/bench_kernels_linear.py's shapes, wo_a grouped) at
1, 2, 4, 16, 64, 1024 and 8192 rows: cuBLAS on the dequantised bf16 weight
against each FP8 path on the same x, in one process. Each side is timed as one CUDA graph
that calls it on C copies of its weight in turn (C x weight bytes > 2x the H200's 60 MB L2, as
a decode step reads every layer's weights once), R times over; time = graph replay / (C x R),
median of 5 replays. Paths (`_paths`): the served switches, "exact" (`linear_weights=checkpoint`:
the GEMV up to GEMV_MAX_ROWS, dequantise + cuBLAS above) and "fp8_switch"
(`linear_activations=fp8`), and issue 21's candidates, each a `tune` of fp8_linear on the same
x: "gemv_rowtile" (1-4 rows), "gemv_fused_reduce", "tiled_swap", "w8a8_fused_reduce" (4-64
rows), "w8a8" (1024+ rows, prefill tiles W8A8_PREFILL) and "w8a8_cublas" (every row count:
torch's block-scaled FP8 GEMM, kernels/fp8_linear_cublas.py; for the W8A8 paths every copy is
called once before the capture, so its weight scales are laid out as at a load). In-launch
split-K reduction: kernels/fp8_splitk.py. Well under 8 minutes on the H200 (--deadline-s stops starting cases).
Records: {"name": "fp8_linear_vs_bf16", "linear", "rows", "path", "activations" ("bf16":
exact numerics; "fp8": x quantised per 1x128 group), "config", "bf16_us", "time_us" (= fp8_us),
"speedup", "pct_roofline" (FP8 weight + scales + x + y bytes / time / 4.3 TB/s, or FLOP/s / 790
TFLOP/s (bf16 peak; FP8's is ~2x), the larger), "max_abs_err", "rel_err" (||y - y_exact|| /
||y_exact||, y_exact: the dequantise path), "error" (null, or why the path did not run: its
timing fields are null then), "api" (w8a8_cublas: the torch entry point that ran)}, then
one {"name": "fp8_linear_best", "linear", "rows", "activations", "path", "config", ...} per (linear, rows, activations): the fastest
exact path ("bf16") and the fastest of all ("fp8"), the dispatch table's input.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.bench_kernels_linear import GPU_SIZES
from benchmarks.harness import PEAK_BYTES_PER_S, PEAK_FLOPS, RESULTS_DIR, warm_up_clocks
from dsv4.ops.quant import fp8_block_dequantize, fp8_block_quantize
from kernels import fp8_linear_cublas
from kernels.fp8_linear import (
    fp8_grouped_linear,
    fp8_grouped_linear_ref,
    fp8_linear,
    fp8_linear_ref,
)

DEFAULT_OUT = RESULTS_DIR / "kernels-fp8-linear-vs-bf16-h200.json"
ROWS = [1, 2, 4, 16, 64, 1024, 8192]
DRY = {"rows": [1, 16], "linears": {"wq_a": (256, 512)}, "groups": (2, 128, 256)}
L2_ROTATE_BYTES = 160e6  # > 2x the H200's 60 MB L2
GEMV = {"GEMV": True}
TILED_SWAP = {"GEMV": False, "DEQUANT": False, "SWAP_AB": True, "POST_SCALE": True}
W8A8 = {"GEMV": False, "W8A8": True}
CUBLAS = {"GEMV": False, "CUBLAS": True}  # torch's block-scaled FP8 GEMM (cuBLASLt, sm_90)
FUSED = {"REDUCE": "kernel"}  # split-K partials added inside the GEMM's launch
# W8A8 tiles at prefill rows (BLOCK_K is the 128-column scale block): the served 64 x 128 at 4
# warps, 128 x 128 at 8 warps (one CTA an SM at 216 registers) and 64 x 128 at 8 warps (122
# registers: two CTAs an SM, one's promotion under the other's MMA); ptxas: no spills
W8A8_PREFILL = ({}, {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
                {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 4},
                {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 4})  # fmt: skip


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


def _paths(rows: int) -> list[tuple[str, str, dict]]:
    """(path, activations, tune) at `rows`: the served switches ("exact":
    linear_weights=checkpoint, "fp8_switch": linear_activations=fp8) and issue 21's candidates,
    each a `tune` of fp8_linear: "gemv_rowtile" (few weight rows a program, K whole; STEP_BYTES
    per step), "gemv_fused_reduce" (the served GEMV, split-K partials added in its own launch),
    "tiled_swap" (the tl.dot kernel, weight tile on the MMA's left, in-launch reduce),
    "w8a8" / "w8a8_fused_reduce" (FP8 x FP8, x quantised per 1x128 group), "w8a8_cublas" (the
    same quantisation, torch's block-scaled GEMM: every row count, for CUBLAS_W8A8_MIN_ROWS)."""
    paths = [("exact", "bf16", {}), ("fp8_switch", "fp8", {}), ("w8a8_cublas", "fp8", CUBLAS)]
    if rows <= 4:
        paths += [("gemv_rowtile", "bf16", {**GEMV, "STEP_BYTES": b}) for b in (8192, 16384, 32768)]
        paths.append(("gemv_fused_reduce", "bf16", {**GEMV, **FUSED}))
    if rows == 1:
        paths.append(("gemv", "bf16", {**GEMV, "BLOCK_K": 2048}))
    if rows <= 64:
        paths.append(("tiled_swap", "bf16", {**TILED_SWAP, **FUSED}))
    if 4 <= rows <= 64:
        paths.append(("w8a8_fused_reduce", "fp8", {**W8A8, **FUSED}))
        paths.append(("w8a8_fused_reduce", "fp8", {**W8A8, **FUSED, "BLOCK_N": 128}))
    if rows > 64:  # up to 64 rows "fp8_switch" is the served W8A8
        paths += [("w8a8", "fp8", {**W8A8, **FUSED, **t}) for t in W8A8_PREFILL]
    return paths


def best_records(records: list[dict]) -> list[dict]:
    """Per (linear, rows): the fastest path with exact numerics ("bf16": x as given) and the
    fastest of all ("fp8": what `linear_activations=fp8` may dispatch to), for a dispatch table."""
    best = {}
    for r in records:
        if r.get("error"):
            continue
        for acts in ("bf16", "fp8") if r["activations"] == "bf16" else ("fp8",):
            key = (r["linear"], r["rows"], acts)
            if key not in best or r["time_us"] < best[key]["time_us"]:
                best[key] = r
    keep = ("linear", "rows", "path", "config", "speedup", "pct_roofline", "time_us",
            "bf16_us", "rel_err")  # fmt: skip
    return [{"name": "fp8_linear_best", "activations": key[2], **{k: r[k] for k in keep}}
            for key, r in sorted(best.items())]  # fmt: skip


def run(dry: bool, deadline_s: float, out: Path, rows_only: list[int] | None = None,
        paths_only: set[str] | None = None) -> list[dict]:  # fmt: skip
    dev = "cpu" if dry else "cuda"
    sizes = DRY if dry else GPU_SIZES
    rows_list = rows_only or (DRY["rows"] if dry else ROWS)
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
            for path, act, tune in _paths(rows):
                if paths_only and path not in paths_only:
                    continue
                ref = fp8_grouped_linear_ref if groups > 1 else fp8_linear_ref
                if dry:  # the references stand in for the kernels
                    call = lambda c, s, a=act, r=ref, x=x: r(x, c, s, a)  # noqa: E731
                else:
                    call = lambda c, s, t=tune, a=act: fp8(c, s, t, a)  # noqa: E731
                try:
                    if act == "fp8" and not dry:  # w8a8_cublas (the switch's too from 64
                        for c, s in fp8_sets:  # rows): weight scales laid out once, as at load
                            call(c, s)
                    fp8_us = _time_rotated(call, fp8_sets, rows, dry)
                    y = call(codes, scale).view(exact.shape)
                except Exception as exc:  # a config that fails to build: say so, go on
                    error = f"{type(exc).__name__}: {str(exc)[:300]}"
                    print(f"{name} rows={rows} {path} {tune}: {error}", flush=True)
                    records.append({
                        "name": "fp8_linear_vs_bf16", "linear": name, "rows": rows,
                        "activations": act, "bf16_us": round(bf16_us, 3), "fp8_us": None,
                        "time_us": None, "speedup": None, "pct_roofline": None, "path": path,
                        "config": tune or "served", "error": error, "copies": copies,
                    })  # fmt: skip
                    continue
                max_err, rel_err = _errors(y, exact)
                pct = 100 * max(nbytes / (fp8_us * 1e-6) / PEAK_BYTES_PER_S,
                                flops / (fp8_us * 1e-6) / PEAK_FLOPS)  # fmt: skip
                cfg = {key: v for key, v in tune.items() if key not in ("GEMV", "W8A8", "DEQUANT")}
                records.append({
                    "name": "fp8_linear_vs_bf16", "linear": name, "rows": rows,
                    "activations": act, "bf16_us": round(bf16_us, 3),
                    "fp8_us": round(fp8_us, 3), "time_us": round(fp8_us, 3),
                    "speedup": round(bf16_us / fp8_us, 3), "pct_roofline": round(pct, 1),
                    "path": path, "config": cfg or "served", "max_abs_err": round(max_err, 5),
                    "rel_err": round(rel_err, 6), "copies": copies, "error": None,
                    **({"api": (fp8_linear_cublas._API_IN_USE or [None])[0]}
                       if tune.get("CUBLAS") and not dry else {}),
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
    parser.add_argument("--deadline-s", type=float, default=360.0, help="stop starting cases")
    parser.add_argument("--rows", help="comma-separated row counts (default: ROWS)")
    parser.add_argument("--paths", help="comma-separated path names (default: all of _paths)")
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")] if args.rows else None
    paths = set(args.paths.split(",")) if args.paths else None
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --dry-run)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    records = run(args.dry_run, args.deadline_s, args.out, rows, paths)
    records += best_records(records)
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {len(records)} records to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
