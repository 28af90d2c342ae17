"""The kernel benchmarks' `--dry-run` (CPU, tiny shapes, references), as the tests run it."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORD_KEYS = {"name", "shape", "time_us", "baseline", "baseline_time_us", "speedup",
               "pct_roofline"}  # fmt: skip


def dry_run_records(monkeypatch, tmp_path, script: str, *args: str) -> list[dict]:
    """Run benchmarks/<script> with --dry-run (and `args`); its records, each with the harness's
    keys. The module is in sys.modules while it runs (dataclasses look their module up)."""
    name = f"bench_{Path(script).stem}"
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / script)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, bench)
    spec.loader.exec_module(bench)
    out = tmp_path / f"{name}.json"
    assert bench.main(["--dry-run", "--out", str(out), *args]) == 0
    records = json.loads(out.read_text())
    assert all(set(r) == RECORD_KEYS for r in records)
    return records
