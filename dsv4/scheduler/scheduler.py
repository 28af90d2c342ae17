"""Continuous batching with chunked prefill, decode-first, preemption by recompute.

The engine thread drives it: `add_request` / `abort` at any time, then per step
`schedule()` -> runner -> `update(step_output)`. One batch is in flight at a time; an abort
between `schedule` and `update` frees the request's blocks at once, which is safe because no
block is handed out again before the next `schedule`, i.e. after the step has finished.

Each step: reserve the speculative budget (policy.spec_token_reservation), serve running
requests decodes-first (1 token + k drafts each, then prefill chunks under the token budget),
preempting the least important running request by recompute when KV blocks run out (a
request with nobody less important to preempt waits a step instead), then admit waiting
requests by priority and arrival while blocks, budget and `max_num_seqs` allow (not after a
preemption; a first chunk shrinks to the free blocks), and plan the prefill chunks.

Async scheduling (`schedule_ahead`, `features.async_scheduling`): while a decode-only step runs
on the device, the engine schedules the next one for the same requests (each assumed to emit
one token; the runner feeds the real ones on the device). Then two batches are in flight; every
block handed out meanwhile is for device work queued after the running step (one stream), so
the invariant above holds in stream order.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from dsv4.cache.manager import KVCacheManager
from dsv4.errors import InvalidRequest
from dsv4.scheduler import policy
from dsv4.scheduler.batch import (
    ChunkPlan,
    RequestOutput,
    RequestStepOutput,
    ScheduledBatch,
    ScheduledRequest,
    StepOutput,
)
from dsv4.scheduler.config import SchedulerConfig
from dsv4.scheduler.request import FinishCause, Request, RequestStatus, StopChecker
from dsv4.types import PromptLogprobs

AHEAD_TOKEN = 0  # the token id of a scheduled-ahead decode: the runner feeds the real one


@dataclass
class _Step:
    budget: int
    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)
    charged: dict[str, int] = field(default_factory=dict)  # budget taken per request
    preempted: list[str] = field(default_factory=list)


class Scheduler:
    """One per worker, owned by the engine loop (not thread-safe); see the module docstring."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        *,
        stop_checker: StopChecker | None = None,
    ) -> None:
        self.config = config
        self.kv = kv_manager
        self._stop_checker = stop_checker
        self._requests: dict[str, Request] = {}
        self._waiting: list[Request] = []  # kept in service order
        self._running: list[Request] = []
        self._finished_ids: list[str] = []  # since the last batch
        self._in_flight: ScheduledBatch | None = None
        self._ahead: ScheduledBatch | None = None  # async scheduling: the step after it
        self._num_added = 0
        layout = kv_manager.layout
        self._ratios = tuple(sorted({layout.model.layer_ratio(i) for i in layout.layer_ids}))
        self._planner_args = {
            "mode": config.prefill_chunk_plan,
            "group_size": config.prefill_chunk_group_size,
            "max_model_len": config.max_model_len,
            "window": layout.model.sliding_window,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "area_budget_rows": config.chunk_area_budget,
        }

    # ---- requests in and out -----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request; raises `InvalidRequest` if it can never be served."""
        rid = request.request_id
        if rid in self._requests:
            raise InvalidRequest(f"request id {rid!r} is already in use")
        self.check_fits(request)
        request.status = RequestStatus.WAITING
        request.arrival_seq = self._num_added = self._num_added + 1
        self._requests[rid] = request
        self._enqueue(request)

    def check_fits(self, request: Request) -> None:
        """Raise `InvalidRequest` unless `request` fits the context and, alone, the KV cache
        at its full length: then the most important request can always make progress (it
        preempts the others), so running out of blocks never stalls the pool."""
        cfg, rid = self.config, request.request_id
        if not request.prompt_token_ids or request.max_new_tokens < 1:
            raise InvalidRequest(f"request {rid!r}: need a prompt and max_new_tokens >= 1")
        max_len = request.num_prompt_tokens + request.max_new_tokens
        if max_len > cfg.max_model_len:
            raise InvalidRequest(
                f"request {rid!r}: prompt + max_new_tokens = {max_len} > max_model_len "
                f"{cfg.max_model_len}; shorten the prompt or lower max_new_tokens"
            )
        needed = self.kv.num_blocks_needed(max_len + cfg.num_speculative_tokens)
        if needed > self.kv.num_blocks:
            raise InvalidRequest(
                f"request {rid!r}: {max_len} tokens need {needed} KV blocks and never fit "
                f"this worker's {self.kv.num_blocks}: lower max_new_tokens or shorten the prompt"
            )

    def abort(self, request_id: str) -> bool:
        """Finish a request at any point and free its blocks; False if it is unknown."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._finish(request, FinishCause.ABORTED)
        return True

    def add_adopted(self, request: Request) -> None:
        """A request whose prompt KV was pulled into blocks the KV manager already holds
        (`KVCacheManager.adopt`): it runs at once, decoding from its first output token."""
        rid = request.request_id
        if rid in self._requests:
            raise InvalidRequest(f"request id {rid!r} is already in use")
        if not self.kv.has_request(rid) or len(request.output_token_ids) != 1:
            raise InvalidRequest(f"request {rid!r}: adopt its blocks and first token first")
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        # A place in the service order like any request: with equal keys no adopted request
        # could preempt another, and a decode pool out of blocks would stall for good.
        request.arrival_seq = self._num_added = self._num_added + 1
        self._requests[rid] = request
        self._running.append(request)

    def request_ids(self) -> tuple[str, ...]:
        return tuple(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_preempted_waiting(self) -> int:
        """Preempted requests waiting to be recomputed (they have first claim on blocks)."""
        return sum(1 for r in self._waiting if r.status is RequestStatus.PREEMPTED)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- schedule ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Pick this step's work. Call `update` with its result before scheduling again."""
        if self._in_flight is not None:
            raise RuntimeError("schedule() called twice: update() the in-flight batch first")
        cfg, k = self.config, self.config.num_speculative_tokens
        reserved = policy.spec_token_reservation(
            len(self._running), k, cfg.max_num_seqs, cfg.spec_budget
        )
        step = _Step(budget=cfg.max_num_batched_tokens - reserved)
        for request in policy.decode_first_order(self._running):
            if request.status is RequestStatus.RUNNING and step.budget > 0:
                self._schedule_running(request, step)
        if not step.preempted:
            self._admit_waiting(step)
        requests = tuple(step.scheduled.values())
        batch = ScheduledBatch(
            requests=requests,
            chunk_plans=self._plan_chunks(requests),
            preempted_request_ids=tuple(step.preempted),
            finished_request_ids=tuple(self._finished_ids),
        )
        if batch.is_empty:  # runs nothing and reaches no runner: its finished ids wait for
            return batch  # the next batch (the runner frees their per-request state then)
        self._finished_ids.clear()
        self._in_flight = batch
        return batch

    def _schedule_running(self, request: Request, step: _Step) -> None:
        if request.is_decoding:
            remaining = request.max_new_tokens - len(request.output_token_ids)
            num_new, num_drafts = 1, max(0, min(self.config.num_speculative_tokens, remaining - 1))
        else:
            num_new, num_drafts = min(request.num_uncomputed_tokens, step.budget), 0
        if self._make_room(request, num_new + num_drafts, step):
            self._add_to_step(request, num_new, num_drafts, num_new, step)

    def _admit_waiting(self, step: _Step) -> None:
        cfg = self.config
        per_request_reserve = cfg.num_speculative_tokens if cfg.spec_budget == "adaptive" else 0
        while self._waiting and len(self._running) < cfg.max_num_seqs:
            request = self._waiting[0]
            num_new = min(
                request.num_uncomputed_tokens,
                step.budget - per_request_reserve,
                self._num_admissible_tokens(),  # a shorter first chunk rather than none
            )
            if num_new <= 0:
                return
            self.kv.allocate(request.request_id, request.num_computed_tokens + num_new)
            self._waiting.pop(0)
            request.status = RequestStatus.RUNNING
            self._running.append(request)
            self._add_to_step(request, num_new, 0, num_new + per_request_reserve, step)

    def _num_admissible_tokens(self) -> int:
        """Positions a newly admitted request can get from the free blocks."""
        layout = self.kv.layout
        return (self.kv.num_free_blocks - layout.num_ring_blocks) * layout.block_size

    def _make_room(self, request: Request, num_positions: int, step: _Step) -> bool:
        """Grow `request`'s blocks to cover `num_positions` more positions, preempting less
        important requests if needed. False: nothing less important is left to preempt, so
        `request` sits this step out and keeps its blocks (preempting itself would only throw
        work away: whoever holds the blocks is more important and can preempt it in turn;
        `add_request` guarantees the most important request always fits alone)."""
        rid = request.request_id
        extra = request.num_computed_tokens + num_positions - self.kv.num_tokens(rid)
        if extra <= 0:
            return True
        key = policy.service_order_key(request)
        while not self.kv.can_append(rid, extra):
            victim = policy.pick_preemption_victim(
                r for r in self._running if policy.service_order_key(r) > key
            )
            if victim is None:
                return False
            self._preempt(victim, step)
        self.kv.append(rid, extra)
        return True

    def _add_to_step(
        self, request: Request, num_new: int, num_drafts: int, charge: int, step: _Step
    ) -> None:
        rid, start = request.request_id, request.num_computed_tokens
        samples_token = start + num_new == request.num_tokens
        params = request.sampling_params
        step.scheduled[rid] = ScheduledRequest(
            request_id=rid,
            token_ids=request.token_ids(start, start + num_new),
            start_position=start,
            is_prefill=not request.is_decoding,
            num_draft_tokens=num_drafts,
            samples_token=samples_token,
            block_table=self.kv.block_table(rid),
            ring_block_ids=self.kv.ring_block_ids(rid),
            sampling_params=params,
            token_history=(request.prompt_token_ids, tuple(request.output_token_ids))
            if samples_token and params is not None and params.has_penalties
            else None,
            prompt_logprob_targets=request.prompt_logprob_targets(start, start + num_new),
        )
        step.charged[rid] = charge
        step.budget -= charge

    def _preempt(self, request: Request, step: _Step) -> None:
        rid = request.request_id
        self.kv.free(rid)
        self._running.remove(request)
        if step.scheduled.pop(rid, None) is not None:
            step.budget += step.charged.pop(rid)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        if not request.output_token_ids:  # its recompute gathers the prompt logprobs again
            request.prompt_logprobs.clear()
        step.preempted.append(rid)
        self._enqueue(request)

    def _plan_chunks(self, requests: tuple[ScheduledRequest, ...]) -> tuple[ChunkPlan, ...]:
        prefills = [r for r in requests if r.is_prefill]
        shapes = [policy.PrefillShape(r.start_position, r.num_tokens) for r in prefills]
        return tuple(
            ChunkPlan(ratio, policy.plan_prefill_chunks(shapes, ratio, **self._planner_args))
            for ratio in self._ratios
        )

    def schedule_ahead(self) -> ScheduledBatch | None:
        """Async scheduling: the next decode step of the in-flight one's requests, scheduled
        before its tokens are known, on the assumption that each of them emits one token
        (its token is a placeholder the runner feeds on the device). `update` of the
        in-flight batch then makes it the in-flight one; a request that ends there (EOS,
        stop id or string, abort) has its work in it dropped by the next `update`, and its
        blocks went back at its finish. None (nothing changed): the next step must be
        scheduled normally - requests wait or sat out, a prefill or drafts, no room."""
        batch = self._in_flight
        if batch is None or self._ahead is not None or self._waiting or batch.prefills:
            return None
        if any(r.num_draft_tokens for r in batch.requests):
            return None
        scheduled_ids = {r.request_id for r in batch.requests}
        if any(r.request_id not in scheduled_ids for r in self._running):
            return None  # one sat out (budget, blocks): the normal schedule decides
        step = _Step(budget=self.config.max_num_batched_tokens)
        for scheduled in batch.requests:
            request = self._requests.get(scheduled.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # ended since the in-flight step was scheduled
            if len(request.output_token_ids) + 1 >= request.max_new_tokens:
                continue  # the in-flight step's token is its last
            rid, start = request.request_id, request.num_computed_tokens + 1
            extra = start + 1 - self.kv.num_tokens(rid)
            if step.budget < 1 or (extra > 0 and not self.kv.can_append(rid, extra)):
                return None  # blocks appended so far stay with their requests (next step's)
            if extra > 0:
                self.kv.append(rid, extra)
            step.scheduled[rid] = ScheduledRequest(
                rid, (AHEAD_TOKEN,), start, False, 0, True, self.kv.block_table(rid),
                self.kv.ring_block_ids(rid), request.sampling_params,
            )  # fmt: skip
            step.budget -= 1
        if not step.scheduled:
            return None
        self._ahead = ScheduledBatch(tuple(step.scheduled.values()), self._plan_chunks(()),
                                     finished_request_ids=tuple(self._finished_ids))  # fmt: skip
        self._finished_ids.clear()
        return self._ahead

    def discard_ahead(self) -> None:
        """The runner could not launch the `schedule_ahead` batch: forget it (its finished
        ids go to the next batch; the blocks it appended stay with their requests)."""
        batch, self._ahead = self._ahead, None
        if batch is not None:
            self._finished_ids[:0] = batch.finished_request_ids

    def discard_in_flight(self) -> ScheduledBatch | None:
        """Forget the in-flight batch (and any batch scheduled ahead of it) after its step
        raised (the engine then aborts their requests); returns it, or None."""
        batch, self._in_flight, self._ahead = self._in_flight, None, None
        return batch

    # ---- update ------------------------------------------------------------------------------
    def update(self, step_output: StepOutput) -> list[RequestOutput]:
        """Apply the runner's results for the in-flight batch: advance computed tokens, append
        sampled tokens, finish on EOS / stop ids / max tokens / stop strings, free blocks."""
        batch, self._in_flight, self._ahead = self._in_flight, self._ahead, None
        if batch is None:
            raise RuntimeError("update() without a scheduled batch")
        by_id = {o.request_id: o for o in step_output.outputs}
        results: list[RequestOutput] = []
        for scheduled in batch.requests:
            request = self._requests.get(scheduled.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            result = self._apply(
                request, scheduled, by_id.get(scheduled.request_id, RequestStepOutput(""))
            )
            if result is not None:
                results.append(result)
        return results

    def _apply(
        self, request: Request, scheduled: ScheduledRequest, output: RequestStepOutput
    ) -> RequestOutput | None:
        new_ids = output.new_token_ids
        expected = (1, 1 + scheduled.num_draft_tokens) if scheduled.samples_token else (0, 0)
        if not expected[0] <= len(new_ids) <= expected[1]:
            raise ValueError(f"request {request.request_id!r}: runner returned {new_ids}")
        prompt = self._gather_prompt_logprobs(request, scheduled, output)
        accepted_drafts = max(0, len(new_ids) - 1)
        request.num_computed_tokens += scheduled.num_tokens + accepted_drafts
        kept, reason = request.append_output_tokens(new_ids)
        checker = self._stop_checker
        if reason is None and kept and checker is not None and checker(request, kept):
            reason = FinishCause.STOP_STRING
        if reason is not None:
            self._finish(request, reason)
        if not kept and reason is None:
            return None
        return RequestOutput(request.request_id, kept, reason, output.logprobs[: len(kept)], prompt)

    @staticmethod
    def _gather_prompt_logprobs(
        request: Request, scheduled: ScheduledRequest, output: RequestStepOutput
    ) -> PromptLogprobs | None:
        """Keep the chunk's prompt logprobs; once the prompt's last chunk samples the first
        token, all of them (sent with it, once)."""
        targets, got = scheduled.prompt_logprob_targets, output.prompt_logprobs
        if len(got) != len(targets):
            raise ValueError(f"request {request.request_id!r}: runner returned {len(got)} "
                             f"prompt logprobs for {len(targets)} positions")  # fmt: skip
        request.prompt_logprobs.extend(got)
        params = request.sampling_params
        if (params is None or params.prompt_logprobs is None or request.output_token_ids
                or not scheduled.samples_token):  # fmt: skip
            return None
        positions, request.prompt_logprobs = tuple(request.prompt_logprobs), []
        return PromptLogprobs(request.prompt_token_ids, positions)

    def _finish(self, request: Request, reason: FinishCause) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv.free(request.request_id)
        for queue in (self._running, self._waiting):
            if request in queue:
                queue.remove(request)
        del self._requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def _enqueue(self, request: Request) -> None:
        bisect.insort(self._waiting, request, key=policy.service_order_key)

    # ---- leak check --------------------------------------------------------------------------
    def find_leaks(self) -> list[str]:
        """Live requests and held blocks (empty list: clean). Used by `tests/leak.py`."""
        leaks = []
        if self._requests:
            leaks.append(f"{len(self._requests)} live requests: {sorted(self._requests)[:8]}")
        if self._in_flight is not None or self._ahead is not None:
            leaks.append("a scheduled batch was never updated")
        return leaks + self.kv.find_leaks()

    def check_no_leaks(self) -> None:
        leaks = self.find_leaks()
        if leaks:
            raise AssertionError("; ".join(leaks))
