"""The checkpoint's formats against bf16 end to end (issue 21), A against B in one call.

    python3 -m benchmarks.bench_e2e_formats --out-dir /tmp/e2e-formats         # a GPU host
    python -m benchmarks.bench_e2e_formats --dry-run --out-dir /tmp/e2e-formats # CPU smoke
    python3 -m benchmarks.bench_e2e_formats --mode colocated --out-dir ...      # an 80 GB card

Runs `bench_e2e`'s probes (one 1024-token prompt for TTFT, one 256-token decode for TPOT at
batch 1, each through `dsv4 loadtest` against `dsv4 up`-style processes: 1 P + 1 D, the
4-layer V4-Flash shape; `--mode colocated`: one worker, where two copies of the slice's bf16
experts, ~52 GB each, do not fit the card) twice on the same inputs: bf16 weights, then MXFP4 experts + FP8
linears as the checkpoint stores them. Writes `e2e_formats` records, `speedup` = bf16 time /
formats time, to `OUT/e2e-formats.json` (no rate sweep, no transformers baseline).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import bench_e2e

PROBES = {"ttft_1024": ("probe_ttft_1024", "mean_ttft_ms"),
          "tpot_b1": ("probe_tpot_b1", "mean_tpot_ms")}  # fmt: skip
MODES = ("disaggregated", "colocated")


def run_weights(out: Path, weights: str, dry_run: bool, mode: str) -> dict:
    """One bench_e2e run (probes only) with every weight served as `weights`; its summary."""
    argv = ["--out-dir", str(out / weights), "--modes", mode, "--rates", "",
            "--prompts-per-rate", "", "--skip-transformers", "--expert-weights", weights,
            "--linear-weights", weights, *(["--dry-run"] if dry_run else [])]  # fmt: skip
    bench_e2e.main(argv)
    return json.loads((out / weights / "e2e-summary.json").read_text())


def records(bf16: dict, formats: dict, mode: str = MODES[0]) -> list[dict]:
    found = []
    for metric, (probe, key) in PROBES.items():
        a = bf16.get(mode, {}).get(probe, {}).get(key)
        b = formats.get(mode, {}).get(probe, {}).get(key)
        found.append({"name": "e2e_formats", "metric": metric, "mode": mode,
                      "bf16_us": None if a is None else a * 1e3,
                      "formats_us": None if b is None else b * 1e3,
                      "speedup": None if not (a and b) else a / b,
                      "expert_weights": "mxfp4", "linear_weights": "fp8"})  # fmt: skip
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model")
    ap.add_argument("--mode", choices=MODES, default=MODES[0])
    args = ap.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    bf16 = run_weights(args.out_dir, "bf16", args.dry_run, args.mode)
    formats = run_weights(args.out_dir, "checkpoint", args.dry_run, args.mode)
    found = records(bf16, formats, args.mode)
    (args.out_dir / "e2e-formats.json").write_text(json.dumps(found, indent=1))
    for r in found:
        print(r["metric"], r["bf16_us"], r["formats_us"], r["speedup"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
