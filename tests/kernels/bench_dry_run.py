"""The kernel benchmarks' `--dry-run` (CPU, tiny shapes, references), as the tests run it."""

from __future__ import annotations

import importlib
import json

RECORD_KEYS = {"name", "shape", "time_us", "baseline", "baseline_time_us", "speedup",
               "pct_roofline"}  # fmt: skip


def dry_run_records(tmp_path, module: str, *args: str) -> list[dict]:
    """`python -m benchmarks.<module> --dry-run` (and `args`), in process; its records, each with
    the harness's keys."""
    bench = importlib.import_module(f"benchmarks.{module}")
    out = tmp_path / f"{module}.json"
    assert bench.main(["--dry-run", "--out", str(out), *args]) == 0
    records = json.loads(out.read_text())
    assert all(set(r) == RECORD_KEYS for r in records)
    return records
