"""Residency files (`dsv4.plan.residency`) and `dsv4 plan --routing-stats`: the plan decides how
many experts per layer stay on the device, the routing counts which; a bad stats file is one
line on stderr and exit status 2."""

from __future__ import annotations

import json

import pytest

from dsv4.commands.cli import main
from dsv4.plan import full_flash_config
from dsv4.plan.residency import (
    RESIDENCY_VERSION,
    Residency,
    ResidencyError,
    read_residency,
    write_residency,
)

FLASH = full_flash_config()
FLASH_LAYERS = FLASH.num_hidden_layers + 1  # the MTP layer is counted last
PLAN = ["plan", "--shape", "flash", "--gpus", "1", "--gpu-mem", "141", "--host-mem", "512"]


def flash_counts() -> list[list[int]]:
    """Layer l's expert e selected (e * 7 + l) % 256 * 3 times: a different order per layer."""
    e = FLASH.n_routed_experts
    return [[(x * 7 + layer) % e * 3 for x in range(e)] for layer in range(FLASH_LAYERS)]


def test_round_trip_orders_by_count_then_id(tmp_path) -> None:
    r = Residency.from_counts([[3, 9, 3, 0], [0, 0, 0, 1]], num_resident=2)
    assert r.order == ((1, 0, 2, 3), (3, 0, 1, 2)) and r.resident(0) == (1, 0)
    assert r.resident_share() == pytest.approx((9 + 3 + 1) / 16)
    path = tmp_path / "r.json"
    write_residency(r, path)
    assert read_residency(path, num_layers=2, num_experts=4) == r
    assert r.with_resident(4).resident(1) == (3, 0, 1, 2)


def _bad(tmp_path, name: str) -> str:
    good = json.loads(Residency.from_counts([[1, 2], [2, 1]]).to_json())
    bodies = {
        "not-json": "{nope",
        "not-an-object": "[1, 2]",
        "wrong-version": json.dumps({**good, "version": RESIDENCY_VERSION + 1}),
        "no-counts": json.dumps({k: v for k, v in good.items() if k != "counts"}),
        "short-row": json.dumps({**good, "counts": [[1], [2, 1]]}),
        "not-a-permutation": json.dumps({**good, "order": [[0, 0], [1, 0]]}),
        "too-many-resident": json.dumps({**good, "num_resident": 3}),
        "text-count": json.dumps({**good, "counts": [["x", 1], [2, 1]]}),
    }
    path = tmp_path / f"{name}.json"
    path.write_text(bodies[name])
    return str(path)


BAD = ["not-json", "not-an-object", "wrong-version", "no-counts", "short-row",
       "not-a-permutation", "too-many-resident", "text-count"]  # fmt: skip


@pytest.mark.parametrize("name", BAD)
def test_bad_files_are_residency_errors(tmp_path, name) -> None:
    with pytest.raises(ResidencyError) as err:
        read_residency(_bad(tmp_path, name))
    assert "\n" not in err.value.message


def test_files_of_another_model_shape_are_refused(tmp_path) -> None:
    path = tmp_path / "r.json"
    write_residency(Residency.from_counts([[1, 2], [2, 1]]), path)
    with pytest.raises(ResidencyError, match="num_layers 2, the model has 3"):
        read_residency(path, num_layers=3)
    with pytest.raises(ResidencyError, match="num_experts 2, the model has 8"):
        read_residency(path, num_experts=8)


@pytest.mark.parametrize("name", [*BAD, "missing", "wrong-layers", "wrong-experts"])
def test_cli_bad_stats_file_is_one_line_and_exit_2(tmp_path, capsys, name) -> None:
    path = str(tmp_path / "missing.json")
    if name in ("wrong-layers", "wrong-experts"):
        counts = flash_counts()
        counts = counts[1:] if name == "wrong-layers" else [row[:-1] for row in counts]
        write_residency(Residency.from_counts(counts), path)
    elif name != "missing":
        path = _bad(tmp_path, name)
    out = tmp_path / "residency.json"
    assert main([*PLAN, "--routing-stats", path, "--residency-out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4 plan: error: --routing-stats") and err.count("\n") == 1
    assert "Traceback" not in err and not out.exists()


def test_cli_keeps_the_most_selected_experts_of_each_layer(tmp_path, capsys) -> None:
    """V4-Flash on one H200 offloads K experts per layer: the 256 - K most selected stay."""
    stats, out = tmp_path / "stats.json", tmp_path / "residency.json"
    write_residency(Residency.from_counts(flash_counts()), stats)
    argv = [*PLAN, "--routing-stats", str(stats), "--residency-out", str(out), "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    k = report["offloaded_per_layer"]
    assert k > 0 and report["residency"]["num_resident"] == 256 - k
    residency = read_residency(out, FLASH_LAYERS, 256)
    for layer, row in enumerate(flash_counts()):
        kept = sorted(range(256), key=lambda e, r=row: -r[e])[: 256 - k]
        assert set(residency.resident(layer)) == set(kept)
        assert min(row[e] for e in kept) >= max(row[e] for e in set(range(256)) - set(kept))
    assert residency.counts == tuple(map(tuple, flash_counts()))
    assert report["residency"]["resident_share"] == round(residency.resident_share(), 4)


def test_cli_text_report_and_a_plan_without_offload_keeps_every_expert(tmp_path, capsys):
    stats, out = tmp_path / "stats.json", tmp_path / "residency.json"
    write_residency(Residency.from_counts(flash_counts()), stats)
    argv = ["plan", "--shape", "flash", "--gpus", "8", "--gpu-mem", "141", "--ep", "1",
            "--routing-stats", str(stats), "--residency-out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "residency: 256 of 256 experts per layer resident" in capsys.readouterr().out
    assert read_residency(out).num_resident == 256


def test_cli_sums_the_dumps_of_several_workers(tmp_path, capsys) -> None:
    """Two workers' dumps: the first favours low expert ids, the second high ones; summed,
    the second's larger counts decide."""
    low = [[256 - x for x in range(256)] for _ in range(FLASH_LAYERS)]
    high = [[3 * x for x in range(256)] for _ in range(FLASH_LAYERS)]
    paths = []
    for i, counts in enumerate((low, high)):
        paths += ["--routing-stats", str(tmp_path / f"w{i}.json")]
        write_residency(Residency.from_counts(counts), paths[-1])
    out = tmp_path / "residency.json"
    assert main([*PLAN, *paths, "--residency-out", str(out)]) == 0
    residency = read_residency(out)
    assert residency.counts[0][255] == 1 + 765 and residency.order[0][0] == 255
    assert "residency:" in capsys.readouterr().out


def test_cli_residency_out_needs_routing_stats(tmp_path, capsys) -> None:
    assert main([*PLAN, "--residency-out", str(tmp_path / "r.json")]) == 2
    assert "--residency-out: give --routing-stats" in capsys.readouterr().err
