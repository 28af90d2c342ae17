"""`benchmarks.bench_e2e.probe_records`: the `e2e_probe` record contract of issue 25 (mode x
metric, time_us in microseconds), from a summary as `bench_e2e` writes it."""

from __future__ import annotations

from benchmarks.bench_e2e import probe_records


def _probe(ttft_ms=None, tpot_ms=None, error=None) -> dict:
    run = {"completed": 2, "failed": 0, "mean_ttft_ms": ttft_ms, "mean_tpot_ms": tpot_ms}
    return {"error": error, "completed": 0, "failed": 2} if error else run


def test_every_mode_and_metric_becomes_one_record_in_microseconds() -> None:
    summary = {
        "model": {"layers": "0,4,128,4"},
        "disaggregated": {"cuda_graphs": True, "probe_ttft_1024": _probe(ttft_ms=30.5),
                          "probe_tpot_b1": _probe(tpot_ms=2.0),
                          "probe_tpot_c64": _probe(tpot_ms=12.25)},
        "colocated": {"cuda_graphs": False, "probe_ttft_1024": _probe(error="timed out"),
                      "probe_tpot_b1": _probe(tpot_ms=2.5)},
    }  # fmt: skip
    records = probe_records(summary)
    got = {(r["mode"], r["metric"]): r["time_us"] for r in records}
    assert got == {
        ("disaggregated", "ttft_1024"): 30500.0, ("disaggregated", "tpot_b1"): 2000.0,
        ("disaggregated", "tpot_c64"): 12250.0, ("colocated", "ttft_1024"): None,
        ("colocated", "tpot_b1"): 2500.0,
    }  # fmt: skip
    assert all(r["name"] == "e2e_probe" and r["sampling"] == "greedy" for r in records)
    failed = next(r for r in records if r["time_us"] is None)
    assert failed["error"] == "timed out" and failed["cuda_graphs"] is False


def test_a_mode_that_failed_to_start_keeps_its_error() -> None:
    records = probe_records({"colocated": {"error": "RuntimeError('no device')"}})
    assert [r["metric"] for r in records] == ["ttft_1024", "tpot_b1"]
    assert all(r["time_us"] is None and "no device" in r["error"] for r in records)
