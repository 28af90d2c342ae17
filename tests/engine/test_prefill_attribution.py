"""benchmarks/prefill_attribution.py: a dry run (CPU, tiny model, the worker's paged engine)
writes one record per format and prompt length with the wall time and null GPU fields; the
summary table of a device record lists its components."""

from __future__ import annotations

import datetime
import json

from benchmarks import prefill_attribution as pa

FIELDS = {"name", "prompt_len", "formats", "wall_us", "kernels_us", "gaps_us", "launches",
          "host_syncs", "components_us", "top_kernels", "card", "date"}  # fmt: skip


def test_dry_run_writes_a_record_per_format(tmp_path, capsys):
    out = tmp_path / "pattr.json"
    assert pa.main(["--dry-run", "--prompt-len", "24", "--out", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [r["formats"] for r in records] == list(pa.FORMATS.values())  # bf16, then checkpoint
    for rec in records:
        assert rec.keys() >= FIELDS and "error" not in rec
        assert rec["name"] == "prefill_attribution" and rec["prompt_len"] == 24
        assert rec["wall_us"] > 0 and rec["core_step_us"] > 0 and rec["role"] == "prefill"
        assert all(rec[k] is None for k in pa.GPU_FIELDS)  # no profiler on the CPU
        assert rec["card"] == "cpu" and datetime.date.fromisoformat(rec["date"])
    assert "prefill 24 tokens, experts=mxfp4,linears=fp8" in capsys.readouterr().out


def test_summary_lists_components_by_time():
    rec = {"prompt_len": 1024, "formats": pa.FORMATS["bf16"], "role": "prefill",
           "wall_us": 1000.0, "core_step_us": 1100.0, "kernels_us": 800.0, "gaps_us": 200.0,
           "launches": 400, "host_syncs": 2.0, "sync_calls": {"cudaStreamSynchronize": 2.0},
           "components_us": {"attention": 300.0, "moe_experts": 500.0},
           "top_kernels": [("_w13_kernel", 250.0)]}  # fmt: skip
    lines = pa.summary(rec).splitlines()
    assert "launches 400" in lines[0] and "host syncs 2.0" in lines[0]
    assert lines[1].split()[:2] == ["moe_experts", "500.0"] and "50.0%" in lines[1]
    assert lines[2].split()[0] == "attention" and lines[3].split()[-1] == "_w13_kernel"
