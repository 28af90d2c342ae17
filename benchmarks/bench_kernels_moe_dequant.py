"""MoE experts over FP8 / MXFP4 weights: dequantise to a bf16 scratch, then the bf16 GEMMs.

    python -m benchmarks.bench_kernels_moe_dequant  # H200: results/kernels-moe-dequant-h200.json
    python -m benchmarks.bench_kernels_moe_dequant --dry-run --out /tmp/d.json  # CPU: tiny, refs

Same record format as benchmarks/bench_kernels.py (pct_roofline is the larger of bandwidth / 4.3 TB/s
and FLOP/s / 790 TFLOP/s over compulsory traffic and work), timed with do_bench (eager, as a
prefill runs; the scratch is up to 1 GiB). V4-Flash experts (D 4096, I 2048, E 256, K 6),
random routing as benchmarks/bench_kernels_moe.py draws it, T = 64 / 256 / 1024 / 4096 / 8192
tokens, for MXFP4 and FP8 weights quantised from the same bf16 experts:
- moe_experts_dequant: kernels/moe.py's `moe_experts_dequant` against `moe_experts`
  dequantising in registers on the same weights: the two sides of `use_dequant`, whose
  DEQUANT_MIN_PAIRS_PER_EXPERT this sweep sets (pairs per expert = 6 T / 256);
- moe_experts_dequant_bf16: the same against `moe_experts` on the bf16 experts, the floor: the
  gap is the dequantise pass (~3.8 ms MXFP4, ~4.5 ms FP8 at full bandwidth).
FLOPs = 6*T*K*D*I; bytes = the quantised weights of the experts hit + x + y.
"""

from __future__ import annotations

from collections.abc import Iterator

from benchmarks.bench_kernels_moe import bf16_experts, moe_step, quantize_experts
from benchmarks.harness import RESULTS_DIR, Case, bench_main, measure, start_run
from kernels import moe

DEFAULT_OUT = RESULTS_DIR / "kernels-moe-dequant-h200.json"
GPU_SIZES = {"dim": 4096, "inter": 2048, "experts": 256, "k": 6,
             "tokens": [64, 256, 1024, 4096, 8192], "formats": ["mxfp4", "fp8"]}  # fmt: skip
DRY_SIZES = {"dim": 64, "inter": 32, "experts": 4, "k": 2, "tokens": [5],
             "formats": ["mxfp4", "fp8"]}  # fmt: skip


def _cases(dev, sizes, dry) -> Iterator[Case]:
    w13, w2 = bf16_experts(sizes, dev)
    # a dry run times the reference on both sides: the Triton kernels need a GPU
    fast = moe.moe_experts_ref if dry else moe.moe_experts_dequant

    def slow(*args):  # the in-register GEMMs, whatever moe_experts' own dispatch would pick
        return (
            moe.moe_experts_ref(*args) if dry else moe.moe_experts(*args, tune={"DEQUANT": False})
        )

    for fmt in sizes["formats"]:
        weights = quantize_experts(w13, w2, fmt)
        for t in sizes["tokens"]:
            args, num_bytes, flops = moe_step(dev, sizes, t, weights, fmt)
            bf16_args = (*args[:3], w13, w2, "bf16", None, None, *args[8:])  # the same step
            shape = f"T={t},D={sizes['dim']},I={sizes['inter']},E={sizes['experts']}," \
                    f"K={sizes['k']},{fmt}"  # fmt: skip
            yield Case("moe_experts_dequant", shape, lambda a=args: fast(*a),
                       f"moe_experts, {fmt} dequantised in registers", lambda a=args: slow(*a),
                       num_bytes, flops, graph=False)  # fmt: skip
            yield Case("moe_experts_dequant_bf16", shape, lambda a=args: fast(*a),
                       "moe_experts on the bf16 experts", lambda a=bf16_args: slow(*a),
                       num_bytes, flops, graph=False)  # fmt: skip
        del weights


def run(dry_run: bool, only: str = "") -> list[dict]:
    dev, sizes = start_run(dry_run, DRY_SIZES, GPU_SIZES)
    return list(measure(_cases(dev, sizes, dry_run), dry_run, only))


def main(argv: list[str] | None = None) -> int:
    return bench_main(__doc__.split("\n")[0], run, DEFAULT_OUT, argv)


if __name__ == "__main__":
    raise SystemExit(main())
