"""The shared part of the kernel benchmarks: a case, its timing, its record, the command line.

A case times `fn` and `baseline_fn` on the same inputs. Times are medians of many repeats:
`triton.testing.do_bench_cudagraph` (CUDA-graph replay, no Python launch overhead) where the
callable can be captured, else `do_bench`. Each record: {"name", "shape", "time_us",
"baseline", "baseline_time_us", "speedup", "pct_roofline"}; pct_roofline is the larger of
achieved bandwidth / 4.3 TB/s and achieved FLOP/s / 790 TFLOP/s (the H200's measured limits),
counting each kernel's compulsory traffic and work.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

PEAK_BYTES_PER_S = 4.3e12
PEAK_FLOPS = 790e12
# Where a run writes its records unless --out says otherwise: benchmarks/results under the
# working directory (the repository root, where the docs run `python -m benchmarks.X`), never
# a path built from this package's own location (an installed wheel's site-packages).
RESULTS_DIR = Path("benchmarks") / "results"


@dataclass
class Case:
    name: str
    shape: str
    fn: Callable[[], object]
    baseline: str
    baseline_fn: Callable[[], object]
    num_bytes: float
    flops: float = 0.0
    graph: bool = True  # time by CUDA-graph replay (False: host work in the baseline)


def time_us(fn: Callable[[], object], dry_run: bool, graph: bool) -> float:
    """Median GPU time in µs (one warm call + one host-timed call on a dry run)."""
    if dry_run:
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    import triton.testing

    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def warm_up_clocks() -> None:
    """Bring the GPU clocks up from idle (~2 s of bf16 GEMMs) before the first timing."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(1500):
        a @ a
    torch.cuda.synchronize()


def start_run(dry_run: bool, dry_sizes: dict, gpu_sizes: dict, *, warm_up: bool = True):
    """A sweep's common start: (device, sizes) for a dry or a GPU run, torch's seed 0, and on
    the GPU the clocks brought up first (unless `warm_up` is False)."""
    torch.manual_seed(0)
    if not dry_run and warm_up:
        warm_up_clocks()
    return ("cpu", dry_sizes) if dry_run else ("cuda", gpu_sizes)


def measure(cases: Iterable[Case], dry_run: bool, only: str = "") -> Iterator[dict]:
    """Time every case (and its baseline) whose name contains `only`; yield its record."""
    for case in cases:
        if only and only not in case.name:
            continue
        t_us = time_us(case.fn, dry_run, case.graph)
        try:
            base_us = time_us(case.baseline_fn, dry_run, case.graph)
        except RuntimeError as exc:  # a baseline that cannot be captured in a CUDA graph
            print(f"{case.baseline}: no CUDA graph ({exc}); timing with do_bench"[:300])
            base_us = time_us(case.baseline_fn, dry_run, graph=False)
        bw = case.num_bytes / (t_us * 1e-6) / PEAK_BYTES_PER_S * 100
        fl = case.flops / (t_us * 1e-6) / PEAK_FLOPS * 100
        print(f"{case.name:24s} {case.shape:52s} {t_us:10.2f} us  base {base_us:10.2f} us "
              f"x{base_us / t_us:6.2f}  bw {bw:5.1f}%  flop {fl:5.1f}%  [{case.baseline}]",
              flush=True)  # fmt: skip
        yield {
            "name": case.name, "shape": case.shape, "time_us": round(t_us, 3),
            "baseline": case.baseline, "baseline_time_us": round(base_us, 3),
            "speedup": round(base_us / t_us, 3), "pct_roofline": round(max(bw, fl), 2),
        }  # fmt: skip


def bench_main(
    description: str,
    run: Callable[[bool, str], list[dict]],
    default_out: Path,
    argv: list[str] | None = None,
) -> int:
    """`--dry-run` (CPU, tiny shapes, references), `--out PATH`, `--only SUBSTRING`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, ref path only")
    parser.add_argument("--out", type=Path, default=None, help=f"default {default_out}")
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --dry-run)")
    records = run(args.dry_run, args.only)
    out = args.out or default_out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {len(records)} records to {out}")
    return 0
