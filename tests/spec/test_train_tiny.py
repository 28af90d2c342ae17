"""`dsv4 train-tiny`: a 2-step run writes a checkpoint that loads with its MTP layer."""

from __future__ import annotations

import json
import math

import torch

from dsv4.commands.cli import main
from dsv4.commands.train_tiny import HELDOUT_MODULE, TRAIN_MODULES, stdlib_tokens
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
