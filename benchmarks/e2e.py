"""The end-to-end latency probes (issue 25), both serving modes in one call.

    python3 -m benchmarks.e2e --out benchmarks/results/e2e-probes-h200.json     # a GPU host
    python -m benchmarks.e2e --dry-run --out /tmp/e2e-probes.json               # CPU smoke

`bench_e2e`'s greedy probes only (no rate sweep, no transformers baseline), through `dsv4
loadtest` against `dsv4 up`-style processes on the 4-layer V4-Flash shape: disaggregated
(1 P + 1 D) and colocated (one engine). Writes a list of `e2e_probe` records: `mode` in
{disaggregated, colocated}, `metric` in {ttft_1024 (one fresh 1024-token prompt), tpot_b1
(one decode), tpot_c64 (64 decodes at once)}, `time_us` (the probe's mean TTFT or TPOT), and
whether CUDA graphs were on. Extra arguments go to `bench_e2e` (e.g. --extra-service-args).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks import bench_e2e


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the records' JSON file")
    ap.add_argument("--work-dir", type=Path, default=None, help="logs and per-request JSONL")
    args, rest = ap.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="dsv4-e2e-") as tmp:
        work = args.work_dir or Path(tmp)
        bench_e2e.main(["--out-dir", str(work), "--rates", "", "--prompts-per-rate", "",
                        "--skip-transformers", *rest])  # fmt: skip
        records = json.loads((work / "e2e-probes.json").read_text())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1))
    for r in records:
        print(r["mode"], r["metric"], r["time_us"], r["error"] or "")
    return 0 if records and all(r["time_us"] is not None for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
