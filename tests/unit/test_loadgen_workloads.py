"""Workload generators and arrival processes: lengths in range, ids in vocabulary, shared
prefixes really shared, file formats parsed, arrival statistics as specified."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from loadgen.arrivals import ArrivalSpec, arrival_offsets_s, schedule
from loadgen.datasets import load_mooncake_trace, load_sharegpt
from loadgen.workloads import (
    FIRST_SAFE_TOKEN_ID,
    LengthRange,
    LoadRequest,
    random_requests,
    shared_prefix_requests,
)


def test_random_lengths_within_range_and_ids_in_vocab():
    reqs = random_requests(200, LengthRange(100, 0.5), LengthRange(20, 0.25), 1000, seed=3)
    assert len(reqs) == 200 and len({r.request_id for r in reqs}) == 200
    for r in reqs:
        assert 50 <= r.input_len <= 150 and len(r.prompt_token_ids) == r.input_len
        assert 15 <= r.output_len <= 25
        assert all(FIRST_SAFE_TOKEN_ID <= t < 1000 for t in r.prompt_token_ids)
    assert min(r.input_len for r in reqs) < 60 and max(r.input_len for r in reqs) > 140
    again = random_requests(200, LengthRange(100, 0.5), LengthRange(20, 0.25), 1000, seed=3)
    assert again == reqs  # seeded


def test_range_ratio_zero_gives_fixed_lengths():
    reqs = random_requests(10, LengthRange(7), LengthRange(3), 50, seed=0)
    assert {(r.input_len, r.output_len) for r in reqs} == {(7, 3)}


def test_shared_prefix_really_shared():
    reqs = shared_prefix_requests(
        12,
        prefix_len=32,
        num_groups=3,
        suffix_len=LengthRange(8),
        output_len=LengthRange(4),
        vocab_size=500,
        seed=1,
    )
    prefixes = [r.prompt_token_ids[:32] for r in reqs]
    assert len(set(prefixes)) == 3
    assert all(prefixes.count(p) == 4 for p in set(prefixes))
    assert len({r.prompt_token_ids[32:] for r in reqs}) == 12  # suffixes are private
    assert all(r.input_len == 40 and max(r.prompt_token_ids) < 500 for r in reqs)


def test_load_request_validation():
    with pytest.raises(ValueError):
        LoadRequest("x", 1, 1)  # no prompt
    with pytest.raises(ValueError):
        LoadRequest("x", 1, 0, prompt_text="hi")


def _write_sharegpt(path):
    entries = [
        {
            "id": "a",
            "conversations": [
                {"from": "human", "value": "x" * 40},
                {"from": "gpt", "value": "y" * 80},
            ],
        },
        {"id": "b", "conversations": [{"from": "human", "value": "lonely"}]},  # skipped
        {
            "id": "c",
            "conversations": [
                {"from": "human", "value": "q" * 20},
                {"from": "gpt", "value": "r" * 8},
            ],
        },
        {
            "id": "d",
            "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "z" * 40}],
        },  # too short
    ]
    path.write_text(json.dumps(entries))


def test_sharegpt_parsing_estimates_lengths(tmp_path):
    path = tmp_path / "sg.json"
    _write_sharegpt(path)
    reqs = load_sharegpt(path, num_prompts=10, seed=0)
    # ceil(chars/4): a = 10 in / 20 out; c = 5 in / 2 out (filtered: out < 4); d: in 1 < 4
    assert [(r.prompt_text, r.input_len, r.output_len) for r in reqs] == [("x" * 40, 10, 20)]
    fixed = load_sharegpt(path, num_prompts=10, seed=0, fixed_output_len=7)
    assert sorted(r.input_len for r in fixed) == [1, 5, 10]
    assert {r.output_len for r in fixed} == {7}
    encoded = load_sharegpt(path, 10, 0, 7, encode=lambda s: [ord(ch) for ch in s])
    assert sorted(len(r.prompt_token_ids) for r in encoded) == [2, 20, 40]
    assert all(r.prompt_text is None for r in encoded)


def test_sharegpt_rejects_non_list(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"conversations": []}')
    with pytest.raises(ValueError):
        load_sharegpt(path, 1, 0)


def test_mooncake_trace_parsing_and_shared_blocks(tmp_path):
    rows = [
        {"timestamp": 1000, "input_length": 12, "output_length": 3, "hash_ids": [7, 8, 9]},
        {"timestamp": 1500, "input_length": 12, "output_length": 2, "hash_ids": [7, 8, 10]},
        {"timestamp": 3000, "input_length": 6, "output_length": 5, "hash_ids": [7]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = load_mooncake_trace(path, None, vocab_size=300, seed=5, block_size=4)
    assert [r.arrival_offset_s for r in reqs] == [0.0, 0.5, 2.0]
    assert [(r.input_len, r.output_len) for r in reqs] == [(12, 3), (12, 2), (6, 5)]
    a, b, c = (r.prompt_token_ids for r in reqs)
    assert a[:8] == b[:8]  # hash ids 7, 8 shared
    assert a[8:12] != b[8:12]  # block 9 vs block 10
    assert c[:4] == a[:4] and len(c) == 6  # block 7, then 2 private tokens
    assert all(0 <= t < 300 for r in reqs for t in r.prompt_token_ids)
    fast = load_mooncake_trace(path, 2, 300, 5, block_size=4, time_scale=0.5)
    assert [r.arrival_offset_s for r in fast] == [0.0, 0.25]


def test_mooncake_trace_bad_line_names_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 3}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=":2:"):
        load_mooncake_trace(path, None, 100, 0)


def test_poisson_rate_and_dispersion():
    offsets = arrival_offsets_s(20001, ArrivalSpec(request_rate=50.0, seed=7))
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert 1.0 / gaps.mean() == pytest.approx(50.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: CV 1
    assert offsets == arrival_offsets_s(20001, ArrivalSpec(request_rate=50.0, seed=7))


def test_gamma_burstiness_changes_dispersion_not_rate():
    gaps = np.diff(arrival_offsets_s(20001, ArrivalSpec(request_rate=10, burstiness=4, seed=1)))
    assert 1.0 / gaps.mean() == pytest.approx(10.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(0.5, abs=0.05)  # CV = 1/sqrt(shape)


def test_constant_and_burst():
    assert arrival_offsets_s(4, ArrivalSpec(request_rate=4.0, mode="constant")) == [
        0.0,
        0.25,
        0.5,
        0.75,
    ]
    assert arrival_offsets_s(3, ArrivalSpec(request_rate=math.inf)) == [0.0, 0.0, 0.0]
    assert arrival_offsets_s(0, ArrivalSpec(request_rate=1.0)) == []
    with pytest.raises(ValueError):
        ArrivalSpec(request_rate=0.0)


def test_schedule_uses_trace_timestamps_only_when_asked():
    reqs = [LoadRequest(f"r{i}", 1, 1, prompt_text="x", arrival_offset_s=i * 2.0) for i in range(3)]
    assert schedule(reqs, ArrivalSpec(request_rate=math.inf)) == [0.0, 2.0, 4.0]
    spec = ArrivalSpec(request_rate=1.0, mode="constant", use_trace_timestamps=False)
    assert schedule(reqs, spec) == [0.0, 1.0, 2.0]
