"""router_svc.output (incremental text, stop strings, stop rules) and router_svc.text_model."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4.config import ModelSection
from dsv4.errors import CheckpointError
from dsv4.text.tokenizer import TextCodec, build_tokenizer
from dsv4.types import FinishReason, SamplingParams
from router_svc.output import IncrementalDetokenizer, OutputTracker
from router_svc.text_model import load_text_model

CODEC = TextCodec(build_tokenizer(1000))
TEXT = "The router chooses the least loaded prefill worker; héllo wörld, 日本語 ✓ done."
IDS = CODEC.encode(TEXT)


def stream(tracker: OutputTracker, ids: list[int], per_message: int = 1) -> tuple[str, list[int]]:
    text, tokens = "", []
    for i in range(0, len(ids), per_message):
        step = tracker.add(ids[i : i + per_message])
        text, tokens = text + step.text, tokens + list(step.token_ids)
        if step.finish_reason is not None:
            break
    return text + tracker.flush(), tokens


def test_incremental_text_equals_the_full_decode() -> None:
    rng = random.Random(0)
    for ids in (IDS, [rng.randrange(2, 748) for _ in range(200)]):
        detok = IncrementalDetokenizer(CODEC, prompt_token_ids=CODEC.encode("Prompt: "))
        pieces = [detok.add(t) for t in ids]
        assert "".join(pieces) == CODEC.decode(ids).rstrip("\ufffd")
    valid = IncrementalDetokenizer(CODEC)
    assert not any("\ufffd" in valid.add(t) for t in IDS)  # partial characters are held back


@pytest.mark.parametrize("per_message", [1, 3])
def test_stop_string_cuts_text_and_never_leaks_a_prefix(per_message: int) -> None:
    tracker = OutputTracker(
        SamplingParams(max_new_tokens=500, stop_strings=("wörld",)), codec=CODEC, eos_token_id=1
    )
    sent: list[str] = []
    for i in range(0, len(IDS), per_message):
        step = tracker.add(IDS[i : i + per_message])
        sent.append(step.text)
        if step.finish_reason is not None:
            break
    text = "".join(sent)
    assert text == TEXT[: TEXT.index("wörld")] and tracker.finish_reason is FinishReason.STOP
    assert tracker.num_tokens < len(IDS)


def test_stop_token_ids_eos_ignore_eos_and_max_new_tokens() -> None:
    ids = [300, 301, 1, 302, 303]
    _, tokens = stream(
        OutputTracker(SamplingParams(max_new_tokens=9), codec=CODEC, eos_token_id=1), ids
    )
    assert tokens == [300, 301, 1]
    ignoring = OutputTracker(
        SamplingParams(max_new_tokens=4, ignore_eos=True), codec=CODEC, eos_token_id=1
    )
    _, tokens = stream(ignoring, ids, per_message=5)
    assert tokens == [300, 301, 1, 302] and ignoring.finish_reason is FinishReason.LENGTH
    stop_ids = OutputTracker(
        SamplingParams(max_new_tokens=9, stop_token_ids=(301,)), codec=None, eos_token_id=None
    )
    _, tokens = stream(stop_ids, ids)
    assert tokens == [300, 301] and stop_ids.finish_reason is FinishReason.STOP


def test_without_a_tokenizer_the_workers_text_is_relayed() -> None:
    tracker = OutputTracker(
        SamplingParams(max_new_tokens=3, stop_strings=("x",)), codec=None, eos_token_id=None
    )
    assert tracker.add([5], "ax").text == "ax"  # stop strings are the workers' job then
    assert tracker.add([6, 7, 8], "b").finish_reason is FinishReason.LENGTH
    assert tracker.token_ids == [5, 6, 7]


def test_text_model_sources(tmp_path: Path) -> None:
    tiny = load_text_model(ModelSection())
    assert tiny.source == "tiny" and (tiny.bos_token_id, tiny.eos_token_id) == (0, 1)
    build_tokenizer(1000).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [7, 8], "bos_token_id": 5}))
    from_dir = load_text_model(ModelSection(path=str(tmp_path)))
    assert from_dir.codec.encode("hello") == CODEC.encode("hello")
    assert (from_dir.bos_token_id, from_dir.eos_token_id) == (5, 7)
    explicit = load_text_model(
        ModelSection(path="/nowhere", tokenizer=str(tmp_path / "tokenizer.json"))
    )
    assert explicit.codec is not None
    assert load_text_model(ModelSection(path=str(tmp_path / "empty"))).codec is None
    with pytest.raises(CheckpointError, match=r"no tokenizer\.json"):
        load_text_model(ModelSection(tokenizer=str(tmp_path / "missing.json")))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"not a valid tokenizer\.json"):
        load_text_model(ModelSection(tokenizer=str(tmp_path / "bad.json")))


def test_loading_the_tokenizer_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from dsv4.config import ModelSection\n"
        "from router_svc.text_model import load_text_model\n"
        "assert load_text_model(ModelSection()).codec is not None\n"
        "import router_svc.server, tests.router_fakes.scripted_workers, tests.router_fakes.harness\n"
        "print([m for m in ('torch', 'triton', 'nixl') if m in sys.modules])\n"
    )
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
