"""Speculative token budget (#51725): reserve draft tokens only for running requests."""

from __future__ import annotations

import pytest

from dsv4.cache import CacheOptions, KVCacheManager, KVLayout
from dsv4.config.model import tiny_config
from dsv4.scheduler import (
    Request,
    RequestStepOutput,
    Scheduler,
    SchedulerConfig,
    StepOutput,
    spec_token_reservation,
)
from tests.leak import assert_no_leaks

LAYOUT = KVLayout.build(tiny_config(), CacheOptions(kv_dtype="bf16", num_speculative_tokens=6))


@pytest.mark.parametrize(
    ("num_running", "adaptive_tokens"),
    # The PR's table with 8192 tokens per step and 6 reserved per request.
    [(1, 8186), (32, 8000), (128, 7424), (1024, 2048)],
)
def test_reservation_matches_the_pr_table(num_running: int, adaptive_tokens: int) -> None:
    adaptive = spec_token_reservation(num_running, 6, 1024, "adaptive")
    static = spec_token_reservation(num_running, 6, 1024, "static")
    assert 8192 - adaptive == adaptive_tokens
    assert 8192 - static == 2048  # the old behaviour, whatever runs


def test_reservation_edges() -> None:
    assert spec_token_reservation(0, 6, 1024, "adaptive") == 0
    assert spec_token_reservation(5, 0, 1024, "static") == 0  # no speculation, no reserve
    assert spec_token_reservation(2000, 2, 1024, "adaptive") == 2048  # capped at max_num_seqs
    with pytest.raises(ValueError, match="spec budget"):
        spec_token_reservation(1, 1, 1, "greedy")


def make_scheduler(mode: str, num_blocks: int = 400) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=8192,
        max_num_seqs=1024,
        max_model_len=40_000,
        num_speculative_tokens=6,
        spec_budget=mode,
    )
    return Scheduler(config, KVCacheManager(LAYOUT, num_blocks))


@pytest.mark.parametrize(("mode", "first_chunk"), [("adaptive", 8186), ("static", 2048)])
def test_lone_long_prompt_gets_the_prefill_budget(mode: str, first_chunk: int) -> None:
    scheduler = make_scheduler(mode)
    scheduler.add_request(Request("long", tuple(range(2, 30_002)), max_new_tokens=4))
    batch = scheduler.schedule()
    assert [r.num_tokens for r in batch.requests] == [first_chunk]
    scheduler.update(StepOutput())
    assert scheduler.abort("long")
    assert_no_leaks(scheduler)


def test_decodes_get_drafts_and_the_step_stays_within_budget() -> None:
    scheduler = make_scheduler("adaptive")
    for i in range(3):
        scheduler.add_request(Request(f"d{i}", (5, 6, 7), max_new_tokens=50))
    batch = scheduler.schedule()  # three short prefills
    scheduler.update(
        StepOutput(tuple(RequestStepOutput(r.request_id, (9,)) for r in batch.requests))
    )
    scheduler.add_request(Request("long", tuple(range(2, 20_002)), max_new_tokens=4))
    batch = scheduler.schedule()
    decodes, prefills = batch.decodes, batch.prefills
    assert [r.request_id for r in batch.requests[:3]] == ["d0", "d1", "d2"]  # decodes first
    assert all(r.num_draft_tokens == 6 and r.num_tokens == 1 for r in decodes)
    # 3 running decodes + the admitted prompt each reserve 6 draft tokens.
    assert prefills[0].num_tokens == 8192 - 3 * 6 - 3 - 6
    assert batch.num_tokens <= 8192
    accepted = (9, 9, 9)  # two drafts accepted + the bonus token
    scheduler.update(StepOutput(tuple(RequestStepOutput(r.request_id, accepted) for r in decodes)))
    request = scheduler.get_request("d0")
    assert request.num_computed_tokens == 3 + 1 + 2 and request.num_tokens == 3 + 1 + 3
    for rid in ("d0", "d1", "d2", "long"):
        scheduler.abort(rid)
    assert_no_leaks(scheduler)


def test_drafts_never_run_past_max_new_tokens() -> None:
    scheduler = make_scheduler("adaptive")
    scheduler.add_request(Request("r", (5, 6), max_new_tokens=3))
    scheduler.schedule()
    scheduler.update(StepOutput((RequestStepOutput("r", (9,)),)))
    (decode,) = scheduler.schedule().requests
    assert decode.num_draft_tokens == 1  # 2 tokens left: 1 draft + the bonus
    (out,) = scheduler.update(StepOutput((RequestStepOutput("r", (9, 9)),)))
    assert out.is_finished and out.new_token_ids == (9, 9)
    assert_no_leaks(scheduler)


def test_budget_must_cover_a_decode_step_of_every_sequence() -> None:
    from dsv4.errors import ConfigError

    with pytest.raises(ConfigError, match="max_num_seqs"):
        SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=64, num_speculative_tokens=1)
    SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=64, num_speculative_tokens=1)
