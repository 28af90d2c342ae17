"""FP8 weight-only linears on one GPU: the fp8_linear kernel against cuBLAS on bf16 weights.

    python -m benchmarks.bench_kernels_linear  # H200: writes results/kernels-linear-h200.json
    python -m benchmarks.bench_kernels_linear --dry-run --out /tmp/l.json   # CPU: tiny shapes, refs

Same record format and timing as benchmarks/bench_kernels.py (CUDA-graph replays; pct_roofline is
the larger of bandwidth / 4.3 TB/s and FLOP/s / 790 TFLOP/s over compulsory traffic and work).
The V4-Flash linears that checkpoints store as FP8 (`features.linear_weights=checkpoint`), at
decode rows (1, 16, 64: weight-bandwidth-bound, the FP8 weight is half the bf16 bytes) and
prefill rows (1024, 8192: compute-bound), with UE8M0 scales:
- fp8_linear: wkv [512, 4096], wq_a [1024, 4096], wq_b [32768, 1024], wo_b [4096, 8192],
  shared expert w1 [2048, 4096] and w2 [4096, 2048], e_proj [4096, 4096], against F.linear on
  the same weight dequantised to bf16 (what `linear_weights=bf16` serves);
- fp8_grouped_linear: wo_a, 8 groups of [1024, 4096], against the bf16 einsum of the model;
- fp8_linear_tile (`--only fp8_linear_tile`): the kernel's own configs (TILE_TUNES, `{}` = the
  default) at 1-1024 rows, each against cuBLAS on the bf16 weight, so the best per row count
  reads off one table. On the H200 the first configs ran at 0.33-0.63x of cuBLAS at 1-16 rows,
  0.03-0.20x at 64 and 0.12-0.20x at 1024+. Swept: SWAP_AB (the dequantised weight as the dot's
  left operand: Hopper's wgmma takes A from registers, B only from shared memory), POST_SCALE
  (the block scale on the dot's sums), row tiles, and DEQUANT (dequantise, then cuBLAS);
- fp8_linear_gemv (`--only fp8_linear_gemv`): the decode GEMV (kernels/fp8_gemv.py) at 1-16
  rows, its default config and GEMV_TUNES, each against cuBLAS on the bf16 weight.
Bytes = the FP8 weight + scales + x + y; FLOPs = 2 T N K.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from benchmarks.harness import RESULTS_DIR, Case, bench_main, measure, start_run
from dsv4.ops.quant import fp8_block_dequantize, fp8_block_quantize
from kernels.fp8_linear import (
    fp8_grouped_linear,
    fp8_grouped_linear_ref,
    fp8_linear,
    fp8_linear_ref,
)

DEFAULT_OUT = RESULTS_DIR / "kernels-linear-h200.json"
GPU_SIZES = {"rows": [1, 16, 64, 1024, 8192], "groups": (8, 1024, 4096),
             "linears": {"wkv": (512, 4096), "wq_a": (1024, 4096), "wq_b": (32768, 1024),
                         "wo_b": (4096, 8192), "shared_w1": (2048, 4096),
                         "shared_w2": (4096, 2048), "e_proj": (4096, 4096)}}  # fmt: skip
DRY_SIZES = {"rows": [3], "groups": (2, 64, 256), "linears": {"wq_a": (128, 256)},
             "tile_rows": [3], "tile_linears": ("wq_a",)}  # fmt: skip
GPU_SIZES["tile_rows"] = [1, 16, 64, 256, 1024]
GPU_SIZES["tile_linears"] = ("wq_a", "wo_b", "shared_w1")
GPU_SIZES["gemv_rows"] = [1, 2, 4, 8, 16]
GPU_SIZES["gemv_linears"] = ("wq_a", "wq_b", "wo_b")
DRY_SIZES["gemv_rows"], DRY_SIZES["gemv_linears"] = [2], ("wq_a",)
# configs swept by fp8_linear_gemv, each against cuBLAS (`{}`: gemv_config's choice; the last:
# dequantise + cuBLAS, the path the GEMV must beat)
GEMV_TUNES = ({}, {"num_warps": 4}, {"BLOCK_N": 32, "num_warps": 4}, {"BLOCK_K": 128},
              {"BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 4}, {"splits": 1},
              {"GEMV": False, "DEQUANT": True})  # fmt: skip
# configs swept by fp8_linear_tile, each against cuBLAS (the kernel's: DEQUANT off)
_KERNEL = {"DEQUANT": False}
TILE_TUNES = ({}, _KERNEL, {**_KERNEL, "POST_SCALE": True}, {**_KERNEL, "BLOCK_M": 16},
              {**_KERNEL, "SWAP_AB": True}, {**_KERNEL, "SWAP_AB": True, "POST_SCALE": True},
              {**_KERNEL, "SWAP_AB": True, "BLOCK_N": 128},
              {**_KERNEL, "SWAP_AB": True, "BLOCK_N": 128, "POST_SCALE": True},
              {"DEQUANT": True})  # fmt: skip


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


def _sweep_cases(dev, sizes, dry, group: str, tunes, base_tune: dict) -> Iterator[Case]:
    """`group`'s configs (each `tunes` entry over `base_tune`) per linear and row count."""

    def launch(args, tune):  # a dry run times the reference: `tune` is the kernel's
        return fp8_linear_ref(*args) if dry else fp8_linear(*args, tune=tune)

    for name in sizes[f"{group}_linears"]:
        n, k = sizes["linears"][name]
        codes, scale, dense = _weight(n, k, dev)
        for t in sizes[f"{group}_rows"]:
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            for tune in tunes:
                label = ",".join(f"{key}={v}" for key, v in tune.items()) or "default"
                yield Case(f"fp8_linear_{group}", f"{name},T={t},N={n},K={k},{label}",
                           lambda a=(x, codes, scale), u={**base_tune, **tune}: launch(a, u),
                           "cuBLAS bf16 F.linear",
                           lambda a=(x, dense): torch.nn.functional.linear(*a),
                           n * k + scale.numel() + 2 * t * (n + k), 2.0 * t * n * k)  # fmt: skip
        del codes, scale, dense


def _tile_cases(dev, sizes, dry) -> Iterator[Case]:
    return _sweep_cases(dev, sizes, dry, "tile", TILE_TUNES, {"GEMV": False})


def _gemv_cases(dev, sizes, dry) -> Iterator[Case]:
    return _sweep_cases(dev, sizes, dry, "gemv", GEMV_TUNES, {"GEMV": True})


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
    dev, sizes = start_run(dry_run, DRY_SIZES, GPU_SIZES)
    gens = (("fp8_linear", _linear_cases), ("fp8_grouped_linear", _grouped_cases),
            ("fp8_linear_tile", _tile_cases), ("fp8_linear_gemv", _gemv_cases))  # fmt: skip
    # a generator whose cases `only` excludes is never started (no weights drawn for it)
    cases = (c for name, gen in gens if only in name for c in gen(dev, sizes, dry_run))
    return list(measure(cases, dry_run, only))


def main(argv: list[str] | None = None) -> int:
    return bench_main(__doc__.split("\n")[0], run, DEFAULT_OUT, argv)


if __name__ == "__main__":
    raise SystemExit(main())
