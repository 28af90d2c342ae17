"""FP8 weight-only linears on one GPU: the fp8_linear kernel against cuBLAS on bf16 weights.

    python benchmarks/kernels_linear.py         # H200: writes results/kernels-linear-h200.json
    python benchmarks/kernels_linear.py --dry-run --out /tmp/l.json   # CPU: tiny shapes, refs

Same record format and timing as benchmarks/kernels.py (CUDA-graph replays; pct_roofline is
the larger of bandwidth / 4.3 TB/s and FLOP/s / 790 TFLOP/s over compulsory traffic and work).
The V4-Flash linears that checkpoints store as FP8 (`features.linear_weights=checkpoint`), at
decode rows (1, 16, 64: weight-bandwidth-bound, the FP8 weight is half the bf16 bytes) and
prefill rows (1024, 8192: compute-bound), with UE8M0 scales:
- fp8_linear: wkv [512, 4096], wq_a [1024, 4096], wq_b [32768, 1024], wo_b [4096, 8192],
  shared expert w1 [2048, 4096] and w2 [4096, 2048], e_proj [4096, 4096], against F.linear on
  the same weight dequantised to bf16 (what `linear_weights=bf16` serves);
- fp8_grouped_linear: wo_a, 8 groups of [1024, 4096], against the bf16 einsum of the model;
- fp8_linear_tile (`--only fp8_linear_tile`): the kernel's own configs at 1, 64 and 1024 rows
  (row tiles, and POST_SCALE: the block scale applied to the dot's sums), each `tune` against
  the default config. On the H200 the default 64-row decode tile ran at
  0.03-0.20x of cuBLAS while 16 rows ran at 0.33-0.63x: tiles of 64+ rows take Hopper's
  wgmma path, whose B operand (the weight, dequantised in registers) goes through shared
  memory; 16-row tiles use mma.sync with B in registers (a hypothesis this sweep tests).
Bytes = the FP8 weight + scales + x + y; FLOPs = 2 T N K.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(ROOT)  # this folder first on sys.path would shadow `kernels`
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import Case, bench_main, measure, warm_up_clocks  # noqa: E402
from dsv4.model.quant import fp8_block_dequantize, fp8_block_quantize  # noqa: E402
from kernels.fp8_linear import (  # noqa: E402
    fp8_grouped_linear,
    fp8_grouped_linear_ref,
    fp8_linear,
    fp8_linear_ref,
)

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "kernels-linear-h200.json"
GPU_SIZES = {"rows": [1, 16, 64, 1024, 8192], "groups": (8, 1024, 4096),
             "linears": {"wkv": (512, 4096), "wq_a": (1024, 4096), "wq_b": (32768, 1024),
                         "wo_b": (4096, 8192), "shared_w1": (2048, 4096),
                         "shared_w2": (4096, 2048), "e_proj": (4096, 4096)}}  # fmt: skip
DRY_SIZES = {"rows": [3], "groups": (2, 64, 256), "linears": {"wq_a": (128, 256)},
             "tile_rows": [3], "tile_linears": ("wq_a",)}  # fmt: skip
GPU_SIZES["tile_rows"], GPU_SIZES["tile_linears"] = [1, 64, 1024], ("wq_a", "wo_b", "shared_w1")
# config overrides swept by fp8_linear_tile, each against the default config
TILE_TUNES = ({"POST_SCALE": True}, {"BLOCK_M": 16}, {"BLOCK_M": 16, "POST_SCALE": True},
              {"BLOCK_M": 32}, {"BLOCK_M": 16, "BLOCK_N": 32},
              {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4})  # fmt: skip


def _weight(n: int, k: int, dev):
    w = torch.randn(n, k, device=dev) / k**0.5
    codes, scale = fp8_block_quantize(w)
    return codes, scale, fp8_block_dequantize(codes, scale, 128, torch.bfloat16)


def _linear_cases(dev, sizes, dry) -> Iterator[Case]:
    fast = fp8_linear_ref if dry else fp8_linear
    for name, (n, k) in sizes["linears"].items():
        codes, scale, dense = _weight(n, k, dev)
        for t in sizes["rows"]:
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            yield Case("fp8_linear", f"{name},T={t},N={n},K={k}",
                       lambda f=fast, a=(x, codes, scale): f(*a), "cuBLAS bf16 F.linear",
                       lambda a=(x, dense): torch.nn.functional.linear(*a),
                       n * k + scale.numel() + 2 * t * (n + k), 2.0 * t * n * k)  # fmt: skip
        del codes, scale, dense


def _tile_cases(dev, sizes, dry) -> Iterator[Case]:
    def launch(args, tune):  # a dry run times the reference: `tune` is the kernel's
        return fp8_linear_ref(*args) if dry else fp8_linear(*args, tune=tune)

    for name in sizes["tile_linears"]:
        n, k = sizes["linears"][name]
        codes, scale, _ = _weight(n, k, dev)
        for t in sizes["tile_rows"]:
            args = (torch.randn(t, k, device=dev, dtype=torch.bfloat16), codes, scale)
            for tune in TILE_TUNES:
                label = ",".join(f"{key}={v}" for key, v in tune.items())
                yield Case("fp8_linear_tile", f"{name},T={t},N={n},K={k},{label}",
                           lambda a=args, u=tune: launch(a, u), "default config",
                           lambda a=args: launch(a, None),
                           n * k + scale.numel() + 2 * t * (n + k), 2.0 * t * n * k)  # fmt: skip
        del codes, scale


def _grouped_cases(dev, sizes, dry) -> Iterator[Case]:
    g, n, k = sizes["groups"]
    codes, scale, dense = _weight(g * n, k, dev)
    w = dense.view(g, n, k)
    fast = fp8_grouped_linear_ref if dry else fp8_grouped_linear
    for t in sizes["rows"]:
        x = torch.randn(1, t, g, k, device=dev, dtype=torch.bfloat16)
        yield Case("fp8_grouped_linear", f"wo_a,T={t},G={g},N={n},K={k}",
                   lambda f=fast, a=(x, codes, scale): f(*a), "bf16 einsum (the model's)",
                   lambda a=x: torch.einsum("bsgk,gok->bsgo", a, w),
                   g * n * k + scale.numel() + 2 * t * g * (n + k), 2.0 * t * g * n * k)  # fmt: skip


def run(dry_run: bool, only: str = "") -> list[dict]:
    dev = "cpu" if dry_run else "cuda"
    sizes = DRY_SIZES if dry_run else GPU_SIZES
    torch.manual_seed(0)
    if not dry_run:
        warm_up_clocks()
    gens = (("fp8_linear", _linear_cases), ("fp8_grouped_linear", _grouped_cases),
            ("fp8_linear_tile", _tile_cases))  # fmt: skip
    # a generator whose cases `only` excludes is never started (no weights drawn for it)
    cases = (c for name, gen in gens if only in name for c in gen(dev, sizes, dry_run))
    return list(measure(cases, dry_run, only))


def main(argv: list[str] | None = None) -> int:
    return bench_main(__doc__.split("\n")[0], run, DEFAULT_OUT, argv)


if __name__ == "__main__":
    raise SystemExit(main())
