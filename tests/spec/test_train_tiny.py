"""`dsv4 train-tiny`: a 2-step run writes a checkpoint that loads with its MTP layer."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dsv4.commands.cli import main
from dsv4.commands.train_tiny import HELDOUT_MODULE, TRAIN_MODULES, stdlib_tokens, train_tiny
from dsv4.config.model import ModelConfig
from dsv4.errors import UsageError
from dsv4.model.moe import halves_fit
from dsv4.model.weights import load_model


def test_corpus_is_deterministic_and_heldout_is_separate() -> None:
    assert list(TRAIN_MODULES) == sorted(TRAIN_MODULES) and HELDOUT_MODULE not in TRAIN_MODULES
    ids = stdlib_tokens(("bisect",), 1024)
    assert torch.equal(ids, stdlib_tokens(("bisect",), 1024)) and ids.max() < 1024


def test_cli_trains_and_writes_a_loadable_checkpoint(tmp_path, capsys) -> None:
    out_dir = tmp_path / "trained"
    assert main(["train-tiny", str(out_dir), "--steps", "2", "--seed", "1"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["num_steps"] == 2 and len(report["loss_curve"]) == 1
    assert math.isfinite(report["final_loss"]) and math.isfinite(report["heldout_mtp_loss"])
    model, cfg = load_model(out_dir)
    assert cfg.has_mtp and len(model.mtp) == 1
    assert (out_dir / "tokenizer.json").exists()


def test_moe_intermediate_size_128_trains_experts_that_take_halves128(tmp_path) -> None:
    report = train_tiny(tmp_path / "i128", steps=1, moe_intermediate_size=128)
    cfg = ModelConfig.from_file(report.out_dir)
    assert cfg.moe_intermediate_size == 128 and halves_fit(cfg.hidden_size, 128)
    assert math.isfinite(report.heldout_loss)
    default = ModelConfig.from_file(train_tiny(tmp_path / "default", steps=1).out_dir)
    assert default.moe_intermediate_size == 64  # the tiny shape, unchanged


@pytest.mark.parametrize("size", [0, 100, 2048, -32])
def test_bad_moe_intermediate_size_is_refused_before_any_work(tmp_path, size) -> None:
    with pytest.raises(UsageError, match=f"--moe-intermediate-size {size}: give a multiple"):
        train_tiny(tmp_path / "t", steps=1, moe_intermediate_size=size)
    assert not (tmp_path / "t").exists()
