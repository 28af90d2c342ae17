"""Render a benchmark results file (a list of records) as a markdown table.

    python -m benchmarks.to_markdown benchmarks/results/kernels-h200.json
Records: {"name", "shape", "time_us", "baseline", "baseline_time_us", "speedup", "pct_roofline"}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def render(records: list[dict]) -> str:
    lines = [
        "| op | shape | time (µs) | baseline | baseline (µs) | speedup | % roofline |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for r in records:
        lines.append(
            f"| {r['name']} | {r['shape']} | {r['time_us']:.2f} | {r['baseline']} | "
            f"{r['baseline_time_us']:.2f} | {r['speedup']:.2f}x | {r['pct_roofline']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    for path in argv:
        print(render(json.loads(Path(path).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
