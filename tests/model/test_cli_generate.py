"""`dsv4 make-tiny` + `dsv4 generate` as a user runs them (in-process, real files)."""

from __future__ import annotations

import json

import pytest

from dsv4.cli import main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("tiny")
    assert main(["make-tiny", str(out), "--seed", "1"]) == 0
    return out


def test_generate_many_prompts_json(tiny_dir, capsys) -> None:
    capsys.readouterr()
    argv = ["generate", "--model", str(tiny_dir), "--prompt", "Hello world"]
    argv += ["--prompt-ids", "5,6,7", "--max-new-tokens", "6", "--json", "--ignore-eos"]
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt_token_ids"][-3:] for r in lines][1] == [5, 6, 7]
    assert all(len(r["output_token_ids"]) == 6 and r["finish_reason"] == "length" for r in lines)
    # Greedy is deterministic: the same command gives the same tokens.
    assert main(argv) == 0
    again = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert again == lines


def test_generate_sampling_is_seed_reproducible(tiny_dir, capsys) -> None:
    argv = ["generate", "--model", str(tiny_dir), "--prompt-ids", "9,10", "--max-new-tokens", "8"]
    argv += ["--temperature", "1.0", "--top-p", "0.9", "--seed", "3", "--json", "--ignore-eos"]
    capsys.readouterr()
    outs = []
    for _ in range(2):
        assert main(argv) == 0
        outs.append(json.loads(capsys.readouterr().out)["output_token_ids"])
    assert outs[0] == outs[1]


def test_generate_rejects_empty_prompt(tiny_dir) -> None:
    with pytest.raises(SystemExit, match="non-empty"):
        main(["generate", "--model", str(tiny_dir), "--prompt", ""])


def test_generate_reports_missing_checkpoint(tmp_path, capsys) -> None:
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "error" in capsys.readouterr().err
