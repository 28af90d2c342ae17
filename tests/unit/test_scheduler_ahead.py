"""`Scheduler.schedule_ahead` (async scheduling): the next decode step is scheduled before the
in-flight one's tokens are known. A pipelined fake runner feeds each scheduled-ahead row the
token its request emitted the step before (what the device does) and checks it against the
oracle; outputs, finish causes and blocks must come out as without running ahead."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.scheduler import FinishCause, Request, RequestStepOutput, ScheduledBatch, StepOutput
from dsv4.scheduler.scheduler import AHEAD_TOKEN
from tests.leak import assert_no_leaks
from tests.unit.test_scheduler import LAYOUT, FakeRunner, make, next_token, prompt


class PipelinedRunner(FakeRunner):
    """Runs step N + 1 (scheduled ahead) before applying step N's tokens."""

    def answer_ahead(self, batch: ScheduledBatch, previous: StepOutput) -> StepOutput:
        emitted = {o.request_id: o.new_token_ids for o in previous.outputs}
        for r in batch.requests:  # the device feed: the token emitted at the previous step
            assert r.token_ids == (AHEAD_TOKEN,) and not r.is_prefill and r.samples_token
            assert emitted[r.request_id] == (next_token(r.request_id, r.start_position - 1),)
            assert len(r.block_table) * LAYOUT.block_size >= r.end_position
        return StepOutput(tuple(RequestStepOutput(r.request_id, (next_token(r.request_id,
                                r.start_position),)) for r in batch.requests))  # fmt: skip

    def run_pipelined(self, aborts: dict[int, str], max_steps: int = 600) -> int:
        """Returns how many steps ran ahead."""
        ahead, previous, num_ahead = None, None, 0
        for n in range(max_steps):
            if ahead is None and not self.scheduler.has_unfinished_requests():
                return num_ahead
            if n in aborts:
                self.scheduler.abort(aborts[n])
            batch = ahead if ahead is not None else self.scheduler.schedule()
            if batch.is_empty:
                continue
            output = self.answer(batch) if ahead is None else self.answer_ahead(batch, previous)
            ahead = self.scheduler.schedule_ahead()
            num_ahead += ahead is not None
            self.record(self.scheduler.update(output))
            previous = output
        raise AssertionError("requests did not finish")


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=5),
    new_tokens=st.lists(st.integers(1, 12), min_size=5, max_size=5),
    eos_at=st.lists(st.integers(0, 14), min_size=5, max_size=5),
    num_blocks=st.integers(12, 40),  # few: preemption happens, then nothing runs ahead
    aborts=st.dictionaries(st.integers(0, 40), st.integers(0, 4), max_size=2),
)
def test_running_ahead_gives_the_oracle_tokens_and_frees_everything(
    lengths: list[int], new_tokens: list[int], eos_at: list[int], num_blocks: int,
    aborts: dict[int, int],
) -> None:  # fmt: skip
    scheduler, _ = make(num_blocks=num_blocks, max_num_batched_tokens=128, max_num_seqs=4)
    runner = PipelinedRunner(scheduler)
    want: dict[str, int] = {}
    for i, length in enumerate(lengths):
        rid = f"r{i}"
        p = prompt(length, i)
        eos = next_token(rid, length - 1 + eos_at[i])  # EOS at that output, if it gets there
        runner.add(Request(rid, p, max_new_tokens=new_tokens[i], eos_token_id=eos))
        want[rid] = min(new_tokens[i], eos_at[i] + 1)
    runner.run_pipelined({n: f"r{i}" for n, i in aborts.items()})
    runner.assert_outputs_match_oracle()
    for rid, n in want.items():
        if runner.finished.get(rid) is not FinishCause.ABORTED and rid in runner.finished:
            assert len(runner.outputs[rid]) == n, rid
    assert set(runner.finished) >= set(want) - {f"r{i}" for i in aborts.values()}
    assert_no_leaks(scheduler)


def test_nothing_runs_ahead_while_requests_wait_or_drafts_are_scheduled() -> None:
    scheduler, runner = make(max_num_seqs=1)
    runner.add(Request("a", prompt(10), max_new_tokens=6))
    runner.add(Request("b", prompt(10, 1), max_new_tokens=6))  # waits: max_num_seqs 1
    runner.step()  # a's prefill
    batch = scheduler.schedule()
    assert batch.decodes and scheduler.schedule_ahead() is None
    runner.record(scheduler.update(runner.answer(batch)))
    runner.run()
    assert_no_leaks(scheduler)


def test_a_request_ending_at_the_running_step_gets_no_token_from_the_next() -> None:
    scheduler, _ = make()
    runner = PipelinedRunner(scheduler)
    runner.add(Request("a", prompt(5), max_new_tokens=4))
    eos = next_token("b", 7 + 2)  # b's third output
    runner.add(Request("b", prompt(8, 1), max_new_tokens=9, eos_token_id=eos))
    assert runner.run_pipelined({}) > 0
    assert len(runner.outputs["a"]) == 4 and runner.outputs["b"][-1] == eos
    assert len(runner.outputs["b"]) == 3 and runner.finished["b"] is FinishCause.EOS
    runner.assert_outputs_match_oracle()
    assert_no_leaks(scheduler)
