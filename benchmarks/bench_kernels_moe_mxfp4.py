"""MXFP4 grouped MoE candidates against bf16 experts and today's served paths, one GPU, one run.

    python -m benchmarks.bench_kernels_moe_mxfp4 --out $OUT/moe-mxfp4-candidates-h200.json
    python -m benchmarks.bench_kernels_moe_mxfp4 --dry-run --out /tmp/c.json   # CPU: tiny shapes
    python -m benchmarks.bench_kernels_moe_mxfp4 --paths stored,gemv_halves128 --out ...

V4-Flash experts (D 4096, I 2048, E 256, top-6), random routing, tokens 1 / 16 / 64 / 1024 /
8192. Timing as benchmarks/bench_kernels_moe_gemv.py: one CUDA graph over ROTATE routings of the
same size (8 at decode sizes, 2 from 1024 tokens), replayed, median per call; every path runs
on the same inputs in this process. Paths (kernels/moe_mxfp4.py):
- "halves128_served": the MXFP4 path at that size with features.mxfp4_layout=halves128
  (repacked once here, as at load): the GEMV to 128 tokens, the halves MMA kernel above;
- "stored": the path served by default (features.mxfp4_layout=stored: GEMV to 128 tokens,
  in-register MMA, dequantise to a bf16 scratch from ~2K tokens);
- "dot_scaled": tl.dot_scaled on the stored layout (tune DOT_SCALED);
- "halves64" / "halves128": the halves MMA kernel (tune GEMV False) on the re-packed layouts;
- "gemv_halves128": the GEMV on the halves128 layout (tune GEMV True), decode sizes only;
- "halves128_bf16" / "halves128_fp32": "halves128" with the codes upcast on the GPU straight
  into bf16 bits (inline PTX) / through fp32 bits (tune HALVES_FP32; kernels/moe_mxfp4.py);
- "w4a8": halves128 experts with activations "fp8" (kernels/moe_w4a8.py, e4m3 x and h on the
  FP8 MMA; its own switch, features.moe_activations), above the GEMV's sizes only.
Each candidate is timed at every config of CONFIGS[size] (the first: `mx_config`'s default).
Records (a JSON list):
- "moe_mxfp4_vs_bf16": {name, tokens, path, time_us (the path's best config), bf16_us, speedup
  (bf16 / path), pct_roofline (the MXFP4 bytes of the experts hit, x and y, at 4.3 TB/s),
  config}: one per (tokens, path), "stored" (the default) included;
- "moe_mxfp4_candidate": {tokens, path, config, time_us} for every config timed;
- "moe_mxfp4_numerics": each path's layer output against `moe_experts_ref` (dequantise, then
  the bf16 GEMMs) on the first step of each size: max abs, relative L2, max relative to max.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.bench_kernels_moe_gemv import _errors, _steps, _time_us, cli, setup
from benchmarks.harness import PEAK_BYTES_PER_S
from kernels import moe, moe_mxfp4

GPU = dict(dim=4096, inter=2048, experts=256, k=6, tokens=[1, 16, 64, 1024, 8192])
DRY = dict(dim=256, inter=128, experts=8, k=2, tokens=[1, 5, 16])  # 16: above the GEMV
ROTATE = 8
# config overrides tried per size class after mx_config's default ({}); weight rows (BLOCK_N) on
# the MMA's M side with SWAP_AB, the expert's pairs (BLOCK_M) on its N side
CONFIGS = {
    "decode": ({}, {"BLOCK_N": 128, "num_warps": 8}, {"num_stages": 4}),
    "1024": ({}, {"BLOCK_N": 64, "num_warps": 4}, {"BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 8}),
    "8192": ({}, {"BLOCK_M": 32}, {"BLOCK_M": 128}, {"SWAP_AB": False, "BLOCK_M": 128}),
}

# the GEMV path (kernels/moe_gemv.py) is timed up to its served bound (128 tokens of V4-Flash)
GEMV_MAX_TOKENS = 128
GEMV_CONFIGS = ({}, {"BLOCK_M": 1}, {"BLOCK_M": 2})
# W4A8 keeps BLOCK_N 128 (one activation group of h a column tile); BLOCK_M 128 spills (sm_90)
W4A8_CONFIGS = ({}, {"BLOCK_M": 64, "num_warps": 8}, {"BLOCK_M": 32, "num_warps": 4},
                {"num_stages": 4})  # fmt: skip


def _size_class(tokens: int) -> str:
    return "decode" if tokens <= 64 else "1024" if tokens <= 2048 else "8192"


def _paths(w_fp4, dry: bool) -> dict:
    """path -> (weights (w13, w2, s13, s2), format, base tune, sizes: "gemv" (decode only),
    "mma" (above the GEMV's) or "all", activations). The candidates' base tune GEMV False keeps
    them on their MMA kernels at every size."""
    w13, w2, s13, s2 = w_fp4
    paths = {"stored": (w_fp4, "mxfp4", None, "all", "bf16"),
             "dot_scaled": (w_fp4, "mxfp4", {"DOT_SCALED": True}, "all", "bf16")}  # fmt: skip
    for block_k in moe_mxfp4.HALVES_BLOCKS:
        halves = (moe_mxfp4.repack_halves(w13, block_k), moe_mxfp4.repack_halves(w2, block_k), s13,
                  s2)  # fmt: skip
        paths[f"halves{block_k}"] = (halves, f"mxfp4_halves{block_k}", {"GEMV": False}, "all",
                                     "bf16")  # fmt: skip
    served = paths["halves128"][0]
    paths["halves128_served"] = (served, "mxfp4_halves128", None, "all", "bf16")
    paths["gemv_halves128"] = (served, "mxfp4_halves128", {"GEMV": True}, "gemv", "bf16")
    for name, fp32 in (("halves128_bf16", False), ("halves128_fp32", True)):
        paths[name] = (served, "mxfp4_halves128", {"GEMV": False, "HALVES_FP32": fp32}, "all",
                       "bf16")  # fmt: skip
    paths["w4a8"] = (served, "mxfp4_halves128", None, "mma", "fp8")
    return paths


def run(dry: bool, limit_s: float, only: frozenset[str] = frozenset()) -> list[dict]:
    """The records of the module doc; `only`: these paths (all when empty)."""
    t0, dev, sizes, w_bf16, w_fp4 = setup(dry, GPU, DRY)
    paths = {p: v for p, v in _paths(w_fp4, dry).items() if not only or p in only}
    records = []
    for t in sizes["tokens"]:
        if time.monotonic() - t0 > limit_s:
            print(f"time limit: stopped before {t} tokens", flush=True)
            break
        count = 2 if dry or t > 64 else ROTATE
        fp4_steps, fp4_bytes = _steps(sizes, t, w_fp4, "mxfp4", dev, count)
        bf16_steps = [(s[0], s[1], s[2], *w_bf16, "bf16", None, None, s[8]) for s in fp4_steps]
        bf16_us = _time_us(lambda *a: moe.moe_experts(*a), bf16_steps, dry)
        print(f"T={t:5d} bf16 {bf16_us:9.2f} us", flush=True)
        ref = moe.moe_experts_ref(*fp4_steps[0])
        for path, (weights, fmt, base, where, acts) in paths.items():
            mma = moe.uses_w4a8(t * sizes["k"], sizes["experts"], fmt, "fp8")  # above the GEMV
            if (where == "gemv" and t > GEMV_MAX_TOKENS) or (where == "mma" and not mma):
                continue
            steps = [(s[0], s[1], s[2], *weights[:2], fmt, *weights[2:], s[8]) for s in fp4_steps]
            configs = (GEMV_CONFIGS if where == "gemv" else W4A8_CONFIGS if acts == "fp8"
                       else [{}] if path in ("halves128_served", "stored")
                       else CONFIGS[_size_class(t)])  # fmt: skip
            timed = []
            for cfg in configs[:1] if dry else configs:
                tune = {**(base or {}), **cfg} or None
                try:
                    us = _time_us(lambda *a, tn=tune, ac=acts: moe.moe_experts(
                        *a, tune=tn, activations=ac), steps, dry)  # fmt: skip
                except Exception as exc:  # a config that does not compile or run: recorded
                    print(f"T={t:5d} {path} {cfg}: {type(exc).__name__} {str(exc)[:200]}")
                    records.append({"name": "moe_mxfp4_candidate", "tokens": t, "path": path,
                                    "config": cfg, "error": str(exc)[:300]})  # fmt: skip
                    continue
                timed.append((us, cfg))
                records.append({"name": "moe_mxfp4_candidate", "tokens": t, "path": path,
                                "config": cfg, "time_us": round(us, 2)})  # fmt: skip
                print(f"T={t:5d} {path:11s} {cfg} {us:9.2f} us", flush=True)
            if not timed:
                continue
            best_us, best = min(timed, key=lambda b: b[0])
            records.append({"name": "moe_mxfp4_vs_bf16", "tokens": t, "path": path,
                            "time_us": round(best_us, 2), "bf16_us": round(bf16_us, 2),
                            "speedup": round(bf16_us / best_us, 3),
                            "pct_roofline": round(fp4_bytes / (best_us * 1e-6)
                                                  / PEAK_BYTES_PER_S * 100, 1),
                            "config": best})  # fmt: skip
            tune = {**(base or {}), **best} or None
            y = moe.moe_experts(*steps[0], tune=tune, activations=acts)
            records.append({"name": "moe_mxfp4_numerics", "tokens": t, "path": path,
                            **_errors(y, ref)})  # fmt: skip
    return records


def table(records: list[dict]) -> str:
    lines = ["| tokens | path | time | bf16 | speedup | % roofline | config |",
             "|---:|---|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in records:
        if r["name"] == "moe_mxfp4_vs_bf16":
            lines.append(f"| {r['tokens']} | {r['path']} | {r['time_us']:.1f} us | "
                         f"{r['bf16_us']:.1f} us | {r['speedup']:.2f}x | "
                         f"{r['pct_roofline']:.0f} | {r['config']} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)  # --paths here, the shared flags in `cli`
    pre.add_argument("--paths", default="", help="comma-separated paths to time (default all)")
    known, rest = pre.parse_known_args(argv)
    only = frozenset(known.paths.split(",")) - {""}
    return cli(rest, __doc__.split("\n")[0], lambda dry, limit: run(dry, limit, only), table,
               "moe_mxfp4_numerics", 360.0)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
