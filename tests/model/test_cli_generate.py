"""`dsv4 make-tiny` + `dsv4 generate` as a user runs them (in-process, real files)."""

from __future__ import annotations

import json

import pytest

from dsv4.commands.cli import main


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


def test_generate_rejects_empty_prompt(tiny_dir, capsys) -> None:
    assert main(["generate", "--model", str(tiny_dir), "--prompt", ""]) == 2
    assert "non-empty" in capsys.readouterr().err


def test_generate_reports_missing_checkpoint(tmp_path, capsys) -> None:
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and len(err.splitlines()) == 1


@pytest.fixture(scope="module")
def ids_only_dir(tiny_dir, tmp_path_factory: pytest.TempPathFactory):
    """The tiny checkpoint without tokenizer.json and with a 12-position context."""
    out = tmp_path_factory.mktemp("ids-only")
    for path in tiny_dir.iterdir():
        if path.name != "tokenizer.json":
            (out / path.name).write_bytes(path.read_bytes())
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 12}))
    return out


def test_prompt_ids_need_no_tokenizer_and_tokens_cap_at_the_context(ids_only_dir, capsys) -> None:
    capsys.readouterr()
    argv = ["generate", "--model", str(ids_only_dir), "--prompt-ids", "1,2,3", "--ignore-eos"]
    assert main([*argv, "--max-new-tokens", "100000", "--json"]) == 0
    out, err = capsys.readouterr()
    record = json.loads(out)
    # 12 positions - 3 prompt tokens: 9 new tokens, and one line saying so.
    assert len(record["output_token_ids"]) == 9 and record["text"] is None
    assert record["finish_reason"] == "length"
    assert err.count("\n") == 1 and "--max-new-tokens 100000 capped" in err
    assert main([*argv, "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip() == ",".join(map(str, record["output_token_ids"][:4]))


def test_text_prompt_without_a_tokenizer_says_use_prompt_ids(ids_only_dir, capsys) -> None:
    assert main(["generate", "--model", str(ids_only_dir), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer.json" in err and "--prompt-ids" in err


def test_skip_tokenizer_init_gives_token_ids_only(tiny_dir, capsys) -> None:
    argv = ["generate", "--model", str(tiny_dir), "--prompt-ids", "9,10", "--max-new-tokens", "3"]
    assert main([*argv, "--ignore-eos", "--json", "--skip-tokenizer-init"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["text"] is None and len(record["output_token_ids"]) == 3
    assert main([*argv, "--skip-tokenizer-init", "--stop", "x"]) == 2
    assert "--stop needs the tokenizer" in capsys.readouterr().err


def test_generate_logprobs_json(tiny_dir, capsys) -> None:
    """--logprobs N with --json: greedy tokens are their position's most likely, so each
    token's logprob is the first of its N best, all <= 0; out of range or without --json is one
    line naming the flag, exit 2."""
    argv = ["generate", "--model", str(tiny_dir), "--prompt-ids", "9,10,11", "--max-new-tokens",
            "5", "--ignore-eos", "--json", "--logprobs", "3"]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out)
    assert len(record["logprobs"]) == len(record["output_token_ids"]) == 5
    for token, lp in zip(record["output_token_ids"], record["logprobs"], strict=True):
        assert len(lp["top"]) == 3 and lp["top"][0][0] == token
        assert lp["logprob"] == lp["top"][0][1] <= 0.0
        assert [v for _, v in lp["top"]] == sorted((v for _, v in lp["top"]), reverse=True)
    for bad in ([*argv[:-1], "21"], [a for a in argv if a != "--json"]):
        assert main(bad) == 2
        err = capsys.readouterr().err.strip()
        assert "--logprobs" in err and "\n" not in err and "Traceback" not in err
