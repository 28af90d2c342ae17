"""Numerics of the served weight formats (`benchmarks/formats_numerics.py`, issue 21 item 3).

The exact paths (`linear_weights=checkpoint`, `expert_weights=checkpoint`) compute on the very
values the dequantising load holds, so on the torch references they give zero error, in one
linear and through a worker's engine. W8A8 (`linear_activations=fp8`) rounds each activation to
e4m3 (3 mantissa bits) per 1x128 group: its error is bounded, not zero. Bounds are the measured
values with margin: one linear 2.5-2.6% relative (docs/BENCHMARKS.md), the random tiny model's
layer 0 3.6%, its logits 14%, argmax agreement 94% (2 x 16 tokens).

The halves paths need experts of whole 128-column blocks, so they run on a random tiny model of
moe_intermediate_size 128: `mxfp4_layout=halves128` re-packs the same codes (exact: 0), W4A8
(`moe_activations=fp8`) rounds x and h to e4m3 (bounded, not 0). On the default I = 64 they are
refused when named, skipped otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks import formats_numerics as fn
from dsv4.config.model import tiny_config
from dsv4.errors import UsageError
from dsv4.model.weights import load_model
from dsv4.ops.fp8 import fp8_linear
from dsv4.ops.quant import fp8_block_dequantize, fp8_block_quantize

PATHS = ("fp8_linears", "mxfp4_experts", "w8a8")
HALVES_PATHS = ("mxfp4_experts", "mxfp4_halves128", "w4a8")
RESULTS = Path(__file__).parents[2] / "benchmarks/results"
# the trained I = 128 model's W4A8 (fp32 / bf16), with margin: layer 1.8% / 1.8%, KL 3.0e-4 /
# 3.1e-4, greedy 100% / 89%
W4A8_LAYER_REL, W4A8_KL, W4A8_GREEDY = 0.03, 1e-3, 0.85


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """The script's dry run (a random tiny checkpoint, 2 prompts x 16 tokens, 4 greedy)."""
    work = tmp_path_factory.mktemp("formats_numerics")
    out = work / "records.json"
    argv = ["--dry-run", "--out", str(out), "--work-dir", str(work), "--paths", ",".join(PATHS)]
    assert fn.main(argv) == 0
    return {r["path"]: r for r in json.loads(out.read_text())}


@pytest.fixture(scope="module")
def halves_run(tmp_path_factory):
    """The dry run on a random tiny checkpoint of I = 128: (work dir, records by path)."""
    work = tmp_path_factory.mktemp("formats_numerics_i128")
    out = work / "records.json"
    argv = ["--dry-run", "--moe-intermediate-size", "128", "--out", str(out), "--work-dir",
            str(work), "--paths", ",".join(HALVES_PATHS)]  # fmt: skip
    assert fn.main(argv) == 0
    return work, {r["path"]: r for r in json.loads(out.read_text())}


def test_dry_run_writes_the_named_fields(records) -> None:
    assert tuple(records) == PATHS
    for record in records.values():
        assert record["name"] == "formats_numerics"
        assert set(fn.FIELDS) <= set(record)
        assert (record["prompts"], record["tokens"]) == (2, 4)
        assert 0.0 <= record["argmax_agree"] <= 1.0 and 0.0 <= record["greedy_agree"] <= 1.0


@pytest.mark.parametrize("path", ["fp8_linears", "mxfp4_experts"])
def test_exact_paths_give_zero_error_through_the_served_switch(records, path) -> None:
    record = records[path]
    for field in ("layer_max_err", "layer_rel_err", "logits_max_err", "logits_rel_err"):
        assert record[field] == 0.0, field
    assert record["kl_nats"] == pytest.approx(0.0, abs=1e-12)
    assert record["argmax_agree"] == record["greedy_agree"] == 1.0


def test_w8a8_error_is_bounded_and_nonzero(records) -> None:
    record = records["w8a8"]
    assert 0.01 < record["layer_rel_err"] < 0.06
    assert 0.0 < record["logits_rel_err"] < 0.25
    assert record["kl_nats"] < 0.03
    assert record["argmax_agree"] >= 0.8


def test_halves128_is_exact_through_the_served_switch(halves_run) -> None:
    record = halves_run[1]["mxfp4_halves128"]
    assert "layout=halves128" in record["candidate"] and "layout=stored" in record["reference"]
    for field in ("layer_max_err", "layer_rel_err", "logits_max_err", "logits_rel_err"):
        assert record[field] == 0.0, field
    assert record["kl_nats"] == pytest.approx(0.0, abs=1e-12)
    assert record["argmax_agree"] == record["greedy_agree"] == 1.0


def test_w4a8_error_is_bounded_and_nonzero(halves_run) -> None:
    record = halves_run[1]["w4a8"]
    assert (
        "moe_activations=fp8" in record["candidate"] and "layout=halves128" in record["reference"]
    )
    assert 0.01 < record["layer_rel_err"] < 0.035  # measured 2.0%
    assert 0.0 < record["logits_rel_err"] < 0.25  # 13% (a random model's small logits)
    assert 0.0 < record["kl_nats"] < 0.03  # 0.009
    assert record["argmax_agree"] >= 0.75 and record["greedy_agree"] >= 0.5  # 84%, 75%


def test_w4a8_refuses_experts_not_in_halves128(halves_run) -> None:
    model, _ = load_model(halves_run[0] / "v4", expert_weights="checkpoint")  # stored layout
    with pytest.raises(fn.NumericsError, match="mxfp4_halves128"):
        fn.W4A8Experts(model.layers[0].ffn)


def test_halves_paths_need_whole_128_column_experts() -> None:
    tiny, i128 = tiny_config(), tiny_config().with_overrides(moe_intermediate_size=128)
    every = list(fn.PATHS)
    assert fn.runnable_paths(every, i128, "paged", named=True) == every
    kept = fn.runnable_paths(every, tiny, "paged", named=False)  # the default: skipped
    assert kept == [p for p in every if p not in fn.HALVES_PATHS]
    assert fn.runnable_paths(every, i128, "reference", named=False) == kept
    with pytest.raises(UsageError, match="--moe-intermediate-size 128"):
        fn.runnable_paths(["w4a8"], tiny, "paged", named=True)
    with pytest.raises(UsageError, match="paged forward only"):
        fn.runnable_paths(["mxfp4_halves128"], i128, "reference", named=True)


def test_named_halves_path_on_a_model_of_i64_is_one_line(tmp_path, capsys) -> None:
    out = tmp_path / "o.json"
    argv = ["--dry-run", "--out", str(out), "--work-dir", str(tmp_path), "--paths", "w4a8"]
    assert fn.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "whole 128-column blocks" in err and "Traceback" not in err
    assert not out.exists() and not (tmp_path / "random").exists()  # refused before any work


def test_committed_cpu_run_meets_the_documented_bounds() -> None:
    """benchmarks/results/formats-numerics-tiny-trained-cpu.json (docs/BENCHMARKS.md): the exact
    paths are exact on the trained model, and W8A8 costs no more greedy agreement than bf16."""
    path = RESULTS / "formats-numerics-tiny-trained-cpu.json"
    got = {r["path"]: r for r in json.loads(path.read_text())}
    assert set(got) == set(fn.PATHS) - set(fn.HALVES_PATHS)  # its experts (I = 64) cannot
    for exact in ("fp8_linears", "mxfp4_experts"):
        assert got[exact]["logits_max_err"] == 0.0 and got[exact]["greedy_agree"] == 1.0
    for w8a8 in ("w8a8", "w8a8_bf16"):
        assert got[w8a8]["layer_rel_err"] < 0.03 and got[w8a8]["greedy_agree"] >= 0.9
        assert got[w8a8]["kl_nats"] < 10 * max(got["bf16_vs_fp32"]["kl_nats"], 1e-4)


def _linear(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5
    weight, scale = fp8_block_quantize(w, 128)
    return torch.randn(16, k, generator=gen), weight, scale


@pytest.mark.parametrize("shape", [(256, 512), (384, 256)])
def test_one_linear_exact_and_w8a8(shape) -> None:
    x, weight, scale = _linear(*shape, seed=sum(shape))
    dense = fp8_block_dequantize(weight, scale, 128, torch.float32)
    want = F.linear(x, dense)
    assert torch.equal(fp8_linear(x, weight, scale), want)
    _, rel = fn.compare(want, fp8_linear(x, weight, scale, activations="fp8"))
    assert 0.02 < rel < 0.03  # e4m3 keeps 3 mantissa bits of each activation


def test_metrics_can_fail() -> None:
    assert fn.kept_fraction([[1, 2, 3], [4, 5, 6]], [[1, 9, 3], [4, 5, 6]]) == 4 / 6
    ref = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    same = fn.logit_metrics(ref, ref.clone())
    assert same["kl_nats"] == 0.0 and same["argmax_agree"] == 1.0
    moved = fn.logit_metrics(ref, torch.tensor([[2.0, 0.0, 0.0], [3.0, 1.0, 0.0]]))
    assert moved["kl_nats"] > 0.1 and moved["argmax_agree"] == 0.5
    assert fn.compare(ref, ref + 0.5) == (0.5, pytest.approx((1.5 / 5) ** 0.5))


def test_a_bad_model_dir_is_one_line(tmp_path, capsys) -> None:
    out = tmp_path / "o.json"
    argv = ["--model", str(tmp_path / "missing"), "--out", str(out), "--work-dir", str(tmp_path)]
    assert fn.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model" in err and "Traceback" not in err
    assert not out.exists()


def test_committed_i128_run_meets_the_documented_bounds() -> None:
    """benchmarks/results/formats-numerics-tiny-trained-i128-cpu.json: the tiny model trained
    with I = 128, every path; halves128 is exact, W4A8 is not but stays bounded."""
    path = RESULTS / "formats-numerics-tiny-trained-i128-cpu.json"
    got = {r["path"]: r for r in json.loads(path.read_text())}
    assert set(got) == set(fn.PATHS)
    for exact in ("fp8_linears", "mxfp4_experts", "mxfp4_halves128"):
        assert got[exact]["logits_max_err"] == 0.0 and got[exact]["greedy_agree"] == 1.0
    for w4a8 in ("w4a8", "w4a8_bf16"):
        assert "moe_activations=fp8" in got[w4a8]["candidate"]
        assert 0.0 < got[w4a8]["layer_rel_err"] < W4A8_LAYER_REL
        assert 0.0 < got[w4a8]["kl_nats"] < W4A8_KL
        assert got[w4a8]["greedy_agree"] >= W4A8_GREEDY
