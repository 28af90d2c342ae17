"""vLLM's `prompt_logprobs`: the scheduler's targets chunk by chunk (every prompt position from
1 once, in order, sent with the first token; gathered again after a preemption mid-prefill;
none for an adopted request), the runner's head slices against torch's log_softmax, the
wire's limit and round trips (sampling, stream chunks, P's result) and the router keeping
them with the first token. Served on the tiny model: tests/engine/test_prompt_logprobs_served.py;
the HTTP shapes: tests/unit/test_openai_echo.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4 import wire
from dsv4.errors import InvalidRequest
from dsv4.rpc.v1 import common_pb2, router_pb2
from dsv4.runner import prompt_logprobs
from dsv4.runner.prompt_logprobs import StepPromptLogprobs
from dsv4.scheduler import (
    Request,
    RequestOutput,
    RequestStepOutput,
    ScheduledBatch,
    ScheduledRequest,
    StepOutput,
)
from dsv4.types import (
    FinishReason,
    PrefillResult,
    PromptLogprobs,
    RequestLimits,
    SamplingParams,
    StreamChunk,
    TokenLogprobs,
    Usage,
)
from router_svc.accounting import RequestAccount
from router_svc.output import OutputTracker
from tests.leak import assert_no_leaks
from tests.unit.test_scheduler import RING, FakeRunner, make, prompt
from tests.unit.test_wire import HANDLE

ASKS = SamplingParams(temperature=0.0, max_new_tokens=4, prompt_logprobs=2)
LIMITS = RequestLimits(vocab_size=400, max_model_len=64, default_max_new_tokens=16)


class PromptRunner(FakeRunner):
    """The fake runner, answering each target with TokenLogprobs(-position, rank=token)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompt_outputs: dict[str, list[PromptLogprobs]] = {}
        self.preempted_after: dict[str, int] = {}  # request -> its outputs when preempted

    def answer(self, batch: ScheduledBatch) -> StepOutput:
        for rid in batch.preempted_request_ids:  # how far it had got
            self.preempted_after[rid] = len(self.outputs[rid])
        out = {o.request_id: o for o in super().answer(batch).outputs}
        for r in batch.requests:
            whole = self.prompts[r.request_id]
            predicted = whole[r.start_position + 1 : min(r.end_position + 1, len(whole))]
            assert r.prompt_logprob_targets in ((), predicted)
            entries = tuple(TokenLogprobs(-float(r.start_position + 1 + i), rank=t)
                            for i, t in enumerate(r.prompt_logprob_targets))  # fmt: skip
            base = out.get(r.request_id, RequestStepOutput(r.request_id))
            out[r.request_id] = dataclasses.replace(base, prompt_logprobs=entries)
        return StepOutput(tuple(out.values()))

    def record(self, results: list[RequestOutput]) -> None:
        for result in results:
            if result.prompt_logprobs is not None:
                assert result.new_token_ids and not self.outputs[result.request_id]
                self.prompt_outputs.setdefault(result.request_id, []).append(
                    result.prompt_logprobs)  # fmt: skip
        super().record(results)


def _assert_every_position_once(runner: PromptRunner, rid: str) -> None:
    (sent,) = runner.prompt_outputs[rid]
    whole = runner.prompts[rid]
    assert sent.token_ids == whole
    assert [e.logprob for e in sent.positions] == [-float(p) for p in range(1, len(whole))]
    assert [e.rank for e in sent.positions] == list(whole[1:])


def test_chunks_cover_every_prompt_position_once_and_send_them_with_the_first_token() -> None:
    scheduler, _ = make(max_num_batched_tokens=7, max_num_seqs=4)
    runner = PromptRunner(scheduler)
    runner.add(Request("a", prompt(30), max_new_tokens=4, sampling_params=ASKS))
    runner.add(Request("b", prompt(1, 1), max_new_tokens=2, sampling_params=ASKS))
    runner.add(Request("plain", prompt(9, 2), max_new_tokens=2))
    runner.run()
    chunks = [r for b in runner.batches for r in b.requests if r.request_id == "a" and r.is_prefill]
    assert len(chunks) > 4 and all(r.prompt_logprob_targets for r in chunks[:-1])
    _assert_every_position_once(runner, "a")
    assert runner.prompt_outputs["b"] == [PromptLogprobs(prompt(1, 1), ())]
    assert "plain" not in runner.prompt_outputs
    runner.assert_outputs_match_oracle()
    assert_no_leaks(scheduler)


def test_a_request_preempted_mid_prefill_gathers_its_prompt_logprobs_again() -> None:
    # "low" prefills in chunks of 100; "vip" decodes past 256 tokens and needs its blocks
    scheduler, _ = make(num_blocks=2 * RING + 2, max_num_batched_tokens=100)
    runner = PromptRunner(scheduler)
    runner.add(Request("vip", prompt(250, 1), max_new_tokens=20, priority=0))
    runner.add(Request("low", prompt(400, 2), max_new_tokens=2, priority=1,
                       sampling_params=ASKS))  # fmt: skip
    runner.run()
    assert runner.preempted_after == {"low": 0}  # preempted before its first token
    _assert_every_position_once(runner, "low")
    runner.assert_outputs_match_oracle()
    assert_no_leaks(scheduler)


def test_an_adopted_request_neither_computes_nor_sends_prompt_logprobs() -> None:
    scheduler, _ = make()
    runner = PromptRunner(scheduler)
    request = Request("d", prompt(20), max_new_tokens=3, sampling_params=ASKS)
    runner.prompts["d"], runner.outputs["d"] = request.prompt_token_ids, []
    request.output_token_ids.append(2 + (sum(map(ord, "d")) * 31 + 19 * 7) % 997)  # P's token
    scheduler.kv.adopt("d", request.num_prompt_tokens)
    scheduler.add_adopted(request)
    runner.run()
    assert not runner.prompt_outputs and len(runner.outputs["d"]) == 2
    assert_no_leaks(scheduler)


def _scheduled(rid: str, targets: tuple[int, ...], n: int | None) -> ScheduledRequest:
    params = SamplingParams(prompt_logprobs=n)
    return ScheduledRequest(rid, (1,) * 9, 0, True, 0, False, (), (), params,
                            prompt_logprob_targets=targets)  # fmt: skip


def test_the_head_runs_in_slices_and_matches_torchs_log_softmax(monkeypatch) -> None:
    monkeypatch.setattr(prompt_logprobs, "HEAD_ROWS", 3)
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(50, 4 * 8, generator=gen)  # a head: [R, M=4, D=8] -> [R, V=50]

    def head(rows: torch.Tensor) -> torch.Tensor:
        assert rows.shape[0] <= 3  # never more rows at once
        return rows.flatten(1) @ weight.T

    streams = torch.randn(9, 4, 8, generator=gen)
    targets = (3, 7, 7, 0, 49, 12, 5)  # 7 rows: slices of 3, 3, 1
    batch = ScheduledBatch((_scheduled("a", targets, 4), _scheduled("b", (), None)))
    assert StepPromptLogprobs.of(ScheduledBatch(batch.requests[1:]), head) is None  # none asked
    step = StepPromptLogprobs.of(batch, head)
    assert step is not None
    for request in batch.requests:
        step.add(request, streams)
    got = step.fetch()
    assert set(got) == {"a"} and len(got["a"]) == len(targets)
    reference = torch.log_softmax(streams[: len(targets)].flatten(1) @ weight.T, dim=-1)
    for row, (token, entry) in enumerate(zip(targets, got["a"])):
        assert entry.logprob == pytest.approx(float(reference[row, token]), abs=1e-5)
        assert entry.rank == int((reference[row] >= reference[row, token]).sum())
        values, ids = torch.topk(reference[row], 4)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-5)


def test_the_wire_carries_prompt_logprobs_and_checks_the_limit() -> None:
    for n in (None, 0, 20):
        sampling = SamplingParams(max_new_tokens=8, prompt_logprobs=n)
        assert wire.sampling_from_proto(wire.sampling_to_proto(sampling), LIMITS, 4) == sampling
    for n in (-1, 21):
        with pytest.raises(InvalidRequest, match=rf"^sampling.prompt_logprobs = {n}: must be"):
            wire.sampling_from_proto(common_pb2.SamplingParams(prompt_logprobs=n), LIMITS, 4)
    prompt = PromptLogprobs((5, 6, 7), (TokenLogprobs(-1.5, ((9, -0.5),), 4),
                                        TokenLogprobs(-float("inf"), (), 400)))  # fmt: skip
    for chunk in (StreamChunk((3,), "a", prompt_logprobs=prompt),
                  StreamChunk((3,), "", FinishReason.LENGTH, Usage(), (TokenLogprobs(-1.0),),
                              PromptLogprobs((5,), ()))):  # fmt: skip
        assert wire.generate_response_from_proto(wire.generate_response_to_proto(chunk)) == chunk
        assert wire.decode_response_from_proto(wire.decode_response_to_proto(chunk)) == chunk
    first = PrefillResult(42, HANDLE, prompt_logprobs=prompt)
    assert wire.prefill_result_from_proto(wire.prefill_result_to_proto(first)) == first
    plain = dataclasses.replace(first, prompt_logprobs=None)
    assert wire.prefill_result_from_proto(wire.prefill_result_to_proto(plain)) == plain
    short = router_pb2.GenerateResponse(token_ids=[3])
    short.prompt_logprobs.token_ids.extend([5, 6, 7])
    short.prompt_logprobs.positions.add(logprob=-1.0)
    with pytest.raises(InvalidRequest, match="3 token_ids but 1 positions"):
        wire.generate_response_from_proto(short)


def test_the_router_sends_them_with_the_first_token() -> None:
    tracker = OutputTracker(ASKS, codec=None, eos_token_id=1)
    account = RequestAccount(3, tracker, received_at_s=0.0)
    prompt = PromptLogprobs((5, 6, 7), (TokenLogprobs(-1.0), TokenLogprobs(-2.0)))
    first = account.chunk(tracker.add((9,), "", (), prompt))
    assert first.prompt_logprobs == prompt and first.token_ids == (9,)
    assert account.chunk(tracker.add((8,))).prompt_logprobs is None
    last = account.chunk(tracker.add((7,), "", (), prompt), FinishReason.LENGTH)
    assert last.prompt_logprobs == prompt and last.usage is not None  # max_new_tokens 1
