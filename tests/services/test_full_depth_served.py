"""The full-depth served benchmark's whole path on CPU (`benchmarks/full_depth_served.py`): `dsv4
up --layout auto` on a device budget that makes the tiny model offload experts, then the greedy
`dsv4 loadtest` probes and the worker's offload counters per probe."""

from __future__ import annotations

import json


def test_served_probes_through_dsv4_up_with_offload(tmp_path) -> None:
    from benchmarks.full_depth_served import main

    out = tmp_path / "served.json"
    # 8.6 MiB: the weights (the unused MTP layer's too) and workspaces fit one worker only
    # with experts in host memory (4 of 8 a layer)
    argv = ["--shape", "tiny", "--layers", "4", "--device", "cpu", "--device-memory-gib",
            "0.0084", "--host-memory-gib", "1", "--concurrency", "2", "--output-len", "4",
            "--ttft-prompt", "200", "--tpot-prompt", "16", "--step-tokens", "128",
            "--max-model-len", "512", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["plan_line"].startswith("layout: colocated")
    records = result["records"]
    assert [r["metric"] for r in records] == ["ttft_200", "tpot_b1", "tpot_c2"]
    for r in records:
        assert r["name"] == "full_depth_served" and r["failed"] == 0 and r["time_us"] > 0
        assert 0 < r["hit_rate"] < 1 and r["bytes_fetched"] > 0  # experts were copied in
    assert records[0]["completed"] == 3 and records[2]["completed"] == 4
