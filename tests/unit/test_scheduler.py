"""Scheduler: token budget, decode-first, chunked prefill, preemption by recompute, abort at
any point, stop conditions. A fake runner checks every scheduled token against an oracle and
"samples" token f(request, position), so outputs must not depend on how the work was split."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.cache import CacheOptions, KVCacheManager, KVLayout
from dsv4.config.model import tiny_config
from dsv4.errors import InvalidRequest
from dsv4.scheduler import (
    FinishCause,
    Request,
    RequestOutput,
    RequestStatus,
    RequestStepOutput,
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
    StepOutput,
)
from dsv4.types import FinishReason
from tests.leak import assert_no_leaks

LAYOUT = KVLayout.build(tiny_config(), CacheOptions(kv_dtype="bf16"))
RING = LAYOUT.num_ring_blocks
EOS = 1


def next_token(request_id: str, position: int) -> int:
    """The token a perfect model samples after `position` (never EOS unless asked)."""
    return 2 + (sum(map(ord, request_id)) * 31 + position * 7) % 997


class FakeRunner:
    """Checks the batch against the oracle and returns f(request, position) tokens; with
    drafts it accepts `accept` of them (the drafts are the oracle's tokens)."""

    def __init__(self, scheduler: Scheduler, accept: int = 0) -> None:
        self.scheduler = scheduler
        self.accept = accept
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, FinishCause] = {}
        self.batches: list[ScheduledBatch] = []

    def add(self, request: Request) -> None:
        self.prompts[request.request_id] = request.prompt_token_ids
        self.outputs[request.request_id] = []
        self.scheduler.add_request(request)

    def expected_tokens(self, request_id: str, start: int, end: int) -> tuple[int, ...]:
        prompt = self.prompts[request_id]
        full = prompt + tuple(next_token(request_id, p) for p in range(len(prompt) - 1, end))
        return full[start:end]

    def answer(self, batch: ScheduledBatch) -> StepOutput:
        outputs = []
        for r in batch.requests:
            expected = self.expected_tokens(r.request_id, r.start_position, r.end_position)
            assert r.token_ids == expected
            assert len(r.block_table) * LAYOUT.block_size >= r.end_position + r.num_draft_tokens
            assert len(r.ring_block_ids) == RING
            if r.samples_token:
                last = r.end_position - 1
                accepted = min(self.accept, r.num_draft_tokens)
                new = tuple(next_token(r.request_id, last + i) for i in range(accepted + 1))
                outputs.append(RequestStepOutput(r.request_id, new))
        return StepOutput(tuple(outputs))

    def record(self, results: list[RequestOutput]) -> None:
        for out in results:
            self.outputs[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                self.finished[out.request_id] = out.finish_reason

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        self.batches.append(batch)
        if batch.is_empty:
            return []
        results = self.scheduler.update(self.answer(batch))
        self.record(results)
        return results

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")

    def assert_outputs_match_oracle(self) -> None:
        for rid, tokens in self.outputs.items():
            start = len(self.prompts[rid]) - 1
            assert tokens == [next_token(rid, start + i) for i in range(len(tokens))], rid


def make(num_blocks: int = 64, **config: object) -> tuple[Scheduler, FakeRunner]:
    defaults = dict(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=4096)
    scheduler = Scheduler(
        SchedulerConfig(**{**defaults, **config}), KVCacheManager(LAYOUT, num_blocks)
    )
    return scheduler, FakeRunner(scheduler)


def prompt(length: int, seed: int = 0) -> tuple[int, ...]:
    return tuple(2 + (seed * 13 + i) % 900 for i in range(length))


def test_requests_run_to_max_tokens_with_chunked_prefill() -> None:
    scheduler, runner = make(max_num_batched_tokens=256)
    runner.add(Request("a", prompt(600), max_new_tokens=5))
    runner.add(Request("b", prompt(40, 1), max_new_tokens=3))
    runner.run()
    assert runner.finished == {"a": FinishCause.LENGTH, "b": FinishCause.LENGTH}
    assert len(runner.outputs["a"]) == 5 and len(runner.outputs["b"]) == 3
    runner.assert_outputs_match_oracle()
    first = runner.batches[0].requests
    assert [(r.request_id, r.start_position, r.num_tokens) for r in first] == [("a", 0, 256)]
    assert not first[0].samples_token and first[0].is_prefill
    assert_no_leaks(scheduler)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 700), min_size=1, max_size=6),
    budget=st.integers(8, 600),  # the pool holds about two requests: preemption happens
    max_num_seqs=st.integers(1, 4),
)
def test_budget_and_max_num_seqs_are_respected(
    lengths: list[int], budget: int, max_num_seqs: int
) -> None:
    scheduler, runner = make(
        num_blocks=RING * 2 + 4, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs
    )
    for i, length in enumerate(lengths):
        runner.add(Request(f"r{i}", prompt(length, i), max_new_tokens=40, arrival_time_s=i))
    runner.run(max_steps=5000)
    for batch in runner.batches:
        assert batch.num_tokens <= budget
        assert len(batch.requests) <= max_num_seqs
        kinds = [r.is_prefill for r in batch.requests]
        assert kinds == sorted(kinds)  # decodes first
        prefills = batch.prefills
        for plan in batch.chunk_plans:
            covered = [i for c in plan.chunks for i in range(c.start, c.end)]
            assert covered == list(range(len(prefills)))
    assert {plan.ratio for plan in runner.batches[0].chunk_plans} == {0, 4, 128}
    runner.assert_outputs_match_oracle()
    assert_no_leaks(scheduler)


def test_decodes_are_served_before_a_new_long_prefill() -> None:
    scheduler, runner = make(max_num_batched_tokens=100)
    for i in range(3):
        runner.add(Request(f"d{i}", prompt(10, i), max_new_tokens=20, arrival_time_s=i))
    runner.step()  # the three prompts fit in one step
    runner.add(Request("long", prompt(900, 9), max_new_tokens=2, arrival_time_s=9))
    for _ in range(5):
        runner.step()
        batch = runner.batches[-1]
        assert [r.request_id for r in batch.decodes] == ["d0", "d1", "d2"]
        assert [(r.request_id, r.num_tokens) for r in batch.prefills] == [("long", 97)]
    for rid in ("d0", "d1", "d2", "long"):
        scheduler.abort(rid)
    assert_no_leaks(scheduler)


def test_preemption_by_recompute_frees_blocks_and_resumes_identically() -> None:
    # Each request needs RING + 1 blocks up to 256 tokens, RING + 2 after: neither can grow.
    scheduler, runner = make(num_blocks=2 * RING + 2, max_num_batched_tokens=1024)
    runner.add(Request("old", prompt(250, 1), max_new_tokens=20, arrival_time_s=0))
    runner.add(Request("new", prompt(250, 2), max_new_tokens=20, arrival_time_s=1))
    preempted_at = None
    while scheduler.has_unfinished_requests():
        runner.step()
        batch = runner.batches[-1]
        if batch.preempted_request_ids and preempted_at is None:
            preempted_at = len(runner.batches) - 1
            assert batch.preempted_request_ids == ("new",)  # the later arrival goes
            assert [r.request_id for r in batch.requests] == ["old"]
            victim = scheduler.get_request("new")
            assert victim.status is RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
            assert victim.num_preemptions == 1 and len(victim.output_token_ids) > 0
            assert scheduler.kv.num_live_requests == 1
    assert preempted_at is not None
    # The recompute prefill covers prompt + the outputs so far, then decoding continues.
    recompute = [
        r for b in runner.batches[preempted_at:] for r in b.requests
        if r.request_id == "new" and r.start_position == 0
    ]  # fmt: skip
    assert recompute and recompute[0].num_tokens > 250
    assert runner.finished == {"old": FinishCause.LENGTH, "new": FinishCause.LENGTH}
    runner.assert_outputs_match_oracle()
    assert_no_leaks(scheduler)


def test_request_that_cannot_grow_waits_instead_of_preempting_a_more_important_one() -> None:
    scheduler, runner = make(num_blocks=2 * RING + 2, max_num_batched_tokens=1024)
    runner.add(Request("vip", prompt(250, 1), max_new_tokens=4, priority=0, arrival_time_s=5))
    runner.add(Request("low", prompt(254, 2), max_new_tokens=9, priority=1, arrival_time_s=0))
    runner.run()
    assert not [rid for b in runner.batches for rid in b.preempted_request_ids]
    # "low" needed a second block at position 256 and sat out until "vip" finished.
    stalled = [b for b in runner.batches if [r.request_id for r in b.requests] == ["vip"]]
    assert stalled and scheduler.kv.num_free_blocks == 2 * RING + 2
    runner.assert_outputs_match_oracle()
    assert_no_leaks(scheduler)


def test_equal_priority_and_arrival_never_deadlock() -> None:
    scheduler, runner = make(num_blocks=2 * RING + 2, max_num_batched_tokens=1024)
    runner.add(Request("x", prompt(250, 1), max_new_tokens=20))  # same arrival time
    runner.add(Request("y", prompt(250, 2), max_new_tokens=20))
    runner.run()
    assert [rid for b in runner.batches for rid in b.preempted_request_ids] == ["y"]
    runner.assert_outputs_match_oracle()
    assert_no_leaks(scheduler)


def test_more_important_request_preempts_the_less_important_one() -> None:
    scheduler, runner = make(num_blocks=2 * RING + 2, max_num_batched_tokens=1024)
    runner.add(Request("low", prompt(250, 2), max_new_tokens=20, priority=1, arrival_time_s=0))
    runner.add(Request("vip", prompt(250, 1), max_new_tokens=20, priority=0, arrival_time_s=5))
    runner.run()
    preempted = [rid for b in runner.batches for rid in b.preempted_request_ids]
    assert preempted == ["low"]
    runner.assert_outputs_match_oracle()
    assert_no_leaks(scheduler)


@pytest.mark.parametrize("phase", ["before_schedule", "in_flight"])
@pytest.mark.parametrize("abort_step", [0, 1, 2, 3, 5, 9])
def test_abort_at_any_point_frees_everything(phase: str, abort_step: int) -> None:
    scheduler, runner = make(num_blocks=2 * RING + 3, max_num_batched_tokens=128)
    runner.add(Request("a", prompt(300, 1), max_new_tokens=30))  # alive through step 9
    runner.add(Request("b", prompt(200, 2), max_new_tokens=6))
    for step in range(40):
        if step == abort_step and phase == "before_schedule":
            assert scheduler.abort("a")
        elif step == abort_step:  # between schedule() and update(): the step is running
            batch = scheduler.schedule()
            assert scheduler.abort("a")
            assert not scheduler.kv.has_request("a")
            if not batch.is_empty:
                runner.record(scheduler.update(runner.answer(batch)))  # "a"'s result dropped
            continue
        runner.step()
    assert not scheduler.abort("a")  # unknown now
    runner.run()
    assert "a" not in runner.finished and runner.finished["b"] is FinishCause.LENGTH
    assert_no_leaks(scheduler)


def test_eos_stop_ids_and_stop_string_hook_finish_requests() -> None:
    oracle_eos = next_token("e", 4)
    seen: list[tuple[str, tuple[int, ...]]] = []

    def stop_on_third_token(request: Request, new_token_ids: tuple[int, ...]) -> bool:
        seen.append((request.request_id, new_token_ids))
        return request.request_id == "s" and len(request.output_token_ids) == 3

    config = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4, max_model_len=4096)
    scheduler = Scheduler(config, KVCacheManager(LAYOUT, 64), stop_checker=stop_on_third_token)
    runner = FakeRunner(scheduler)
    runner.add(Request("e", prompt(5), max_new_tokens=50, eos_token_id=oracle_eos))
    runner.add(Request("t", prompt(5), max_new_tokens=50, stop_token_ids={next_token("t", 6)}))
    runner.add(Request("s", prompt(5), max_new_tokens=50))
    runner.add(Request("n", prompt(5), max_new_tokens=50, eos_token_id=None))
    runner.run()
    assert runner.finished == {
        "e": FinishCause.EOS,
        "t": FinishCause.STOP_TOKEN,
        "s": FinishCause.STOP_STRING,
        "n": FinishCause.LENGTH,
    }
    assert runner.outputs["e"][-1] == oracle_eos and len(runner.outputs["e"]) == 1
    assert len(runner.outputs["t"]) == 3 and len(runner.outputs["s"]) == 3
    assert len(runner.outputs["n"]) == 50 and all(len(ids) == 1 for _, ids in seen)
    assert runner.batches[-1].finished_request_ids or scheduler.schedule().finished_request_ids
    assert_no_leaks(scheduler)


def test_speculative_decoding_outputs_match_the_oracle() -> None:
    layout = KVLayout.build(tiny_config(), CacheOptions(kv_dtype="bf16", num_speculative_tokens=3))
    config = SchedulerConfig(
        max_num_batched_tokens=64, max_num_seqs=4, max_model_len=4096, num_speculative_tokens=3
    )
    scheduler = Scheduler(config, KVCacheManager(layout, 80))
    runner = FakeRunner(scheduler, accept=2)
    for i in range(3):
        runner.add(Request(f"r{i}", prompt(100 + 90 * i, i), max_new_tokens=40, arrival_time_s=i))
    runner.run()
    assert all(reason is FinishCause.LENGTH for reason in runner.finished.values())
    assert all(len(tokens) == 40 for tokens in runner.outputs.values())
    assert all(b.num_tokens <= 64 for b in runner.batches)
    assert any(r.num_draft_tokens == 3 for b in runner.batches for r in b.requests)
    runner.assert_outputs_match_oracle()
    assert_no_leaks(scheduler)


def test_invalid_requests_are_rejected_up_front() -> None:
    scheduler, _ = make(num_blocks=RING + 2, max_model_len=1000)
    with pytest.raises(InvalidRequest, match="max_model_len"):
        scheduler.add_request(Request("long", prompt(990), max_new_tokens=20))
    with pytest.raises(InvalidRequest, match="never fit"):
        scheduler.add_request(Request("big", prompt(600), max_new_tokens=10))
    with pytest.raises(InvalidRequest):
        scheduler.add_request(Request("empty", (), max_new_tokens=1))
    scheduler.add_request(Request("ok", prompt(10), max_new_tokens=1))
    with pytest.raises(InvalidRequest, match="already in use"):
        scheduler.add_request(Request("ok", prompt(10), max_new_tokens=1))
    with pytest.raises(RuntimeError, match="without a scheduled batch"):
        scheduler.update(StepOutput())
    scheduler.schedule()
    with pytest.raises(RuntimeError, match="twice"):
        scheduler.schedule()
    with pytest.raises(AssertionError, match="never updated"):
        assert_no_leaks(scheduler)
    scheduler.abort("ok")
    scheduler.update(StepOutput())
    assert_no_leaks(scheduler)


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(200, 500), min_size=2, max_size=5),
    aborts=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 4), st.booleans()), max_size=3),
    budget=st.integers(16, 400),
)
def test_random_aborts_under_preemption_pressure_leave_nothing_behind(
    lengths: list[int], aborts: list[tuple[int, int, bool]], budget: int
) -> None:
    """A pool with room for about two requests, random aborts before or during steps: the
    survivors' outputs match the oracle and every block comes back."""
    scheduler, runner = make(num_blocks=2 * RING + 3, max_num_batched_tokens=budget)
    for i, length in enumerate(lengths):
        runner.add(Request(f"r{i}", prompt(length, i), max_new_tokens=60, arrival_time_s=i))
    aborted = set()
    for step in range(5000):
        if not scheduler.has_unfinished_requests():
            break
        batch = scheduler.schedule()
        runner.batches.append(batch)
        for when, index, in_flight in aborts:
            rid = f"r{index}"
            if when == step and in_flight and scheduler.abort(rid):
                aborted.add(rid)
        if not batch.is_empty:
            runner.record(scheduler.update(runner.answer(batch)))
        for when, index, in_flight in aborts:
            rid = f"r{index}"
            if when == step and not in_flight and scheduler.abort(rid):
                aborted.add(rid)
    assert not scheduler.has_unfinished_requests()
    assert set(runner.finished) == set(runner.prompts) - aborted
    runner.assert_outputs_match_oracle()
    assert_no_leaks(scheduler)


def test_finish_causes_map_onto_the_stream_reasons() -> None:
    """The scheduler's causes are finer than a stream's reason: every stop is STOP."""
    stops = (FinishCause.EOS, FinishCause.STOP_TOKEN, FinishCause.STOP_STRING)
    assert all(c.reason is FinishReason.STOP for c in stops)
    assert FinishCause.LENGTH.reason is FinishReason.LENGTH
    assert FinishCause.ABORTED.reason is FinishReason.ABORT
