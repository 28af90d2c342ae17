"""Execute one `ScheduledBatch`: forward -> sample -> `StepOutput`.

The forward is a `dsv4.runner.step_forward.StepForward`: the reference forward
(`dsv4.runner.reference`, the oracle) or the paged forward (`dsv4.runner.paged`, the GPU
serving path), each with its own MTP speculative half. It leaves the logits of the requests to
sample, and the tokens its speculative half already chose; the runner samples the rest.

A step is `launch`ed then `finish`ed (`execute` does both). An all-greedy graph step's tokens
are taken by the graph (`features.greedy_in_graph`): `launch` only queues their [B] int64 copy
to the host, `finish` waits for it - the step's one sync. Between the two the engine may
`launch_ahead` the next step, fed with those tokens on the device (`features.async_scheduling`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.runner.kv_cache import PagedKVCache
from dsv4.runner.sampler import Sampler
from dsv4.runner.step_forward import StepForward, StepResult, sampling_spec
from dsv4.scheduler.batch import RequestStepOutput, ScheduledBatch, StepOutput
from dsv4.speculative.metrics import SpecMetrics
from dsv4.types import TokenLogprobs


@dataclass(frozen=True)
class LaunchedStep:
    """A step queued on the device: its output when already known, else its greedy tokens
    `greedy` [B] int64 (device, one per request in batch order) on their way to `host`."""

    batch: ScheduledBatch
    output: StepOutput | None = None
    greedy: torch.Tensor | None = None
    host: torch.Tensor | None = None  # [B] int64, pinned on CUDA
    copied: torch.cuda.Event | None = None  # recorded after the copy (CUDA)


class ModelRunner:
    """Owned by the `EngineCore` (engine thread)."""

    def __init__(self, forward: StepForward, sampler: Sampler, cache: PagedKVCache) -> None:
        """`cache`: the paged KV cache `forward` computes on (transports register its
        backing); `sampler`: the one `forward`'s speculative half samples with, if any."""
        self.forward = forward
        self.sampler = sampler
        self.cache = cache
        # share of ratio-4 layers whose top-k comes from the IndexCache (a worker metric)
        self.index_cache_hit_ratio = 0.0
        # per-layer expert popularity (a RoutingStats), None unless EngineOptions.routing_stats
        self.routing_stats = None

    @property
    def num_graph_replays(self) -> int:
        """Target-pass replays so far (0 without graphs): tells graph steps from eager ones."""
        return self.forward.num_graph_replays

    @property
    def spec_metrics(self) -> SpecMetrics | None:
        """Drafted / accepted counts per draft position (None without speculation)."""
        return self.forward.spec_metrics

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        return self.finish(self.launch(batch))

    @torch.no_grad()
    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        self._release(batch)
        return self._launched(batch, self.forward.run(batch))

    @torch.no_grad()
    def launch_ahead(self, batch: ScheduledBatch, previous: LaunchedStep) -> LaunchedStep | None:
        """Async scheduling: run `batch` (`Scheduler.schedule_ahead`) on `previous`'s greedy
        tokens, still on the device. None (nothing ran): it needs them on the host."""
        run_ahead = getattr(self.forward, "run_ahead", None)
        rows = {r.request_id: i for i, r in enumerate(previous.batch.requests)}
        if run_ahead is None or previous.greedy is None:
            return None
        if any(r.request_id not in rows for r in batch.requests):
            return None
        result = run_ahead(batch, previous.greedy, [rows[r.request_id] for r in batch.requests])
        if result is None:
            return None
        self._release(batch)
        return self._launched(batch, result)

    def finish(self, launched: LaunchedStep) -> StepOutput:
        """The step's output; for greedy graph tokens, waits for their copy (the one sync)."""
        if launched.output is not None:
            return launched.output
        assert launched.host is not None
        if launched.copied is not None:
            launched.copied.synchronize()
        self._check_step()
        ids = launched.host.tolist()
        requests = launched.batch.requests
        return StepOutput(tuple(RequestStepOutput(r.request_id, (ids[i],))
                                for i, r in enumerate(requests)))  # fmt: skip

    def _check_step(self) -> None:
        """A forward's own check of the step just read (the paged forward's expert pool)."""
        check = getattr(self.forward, "check_step", None)
        if check is not None:
            check()

    def _release(self, batch: ScheduledBatch) -> None:
        for request_id in batch.finished_request_ids:
            self.sampler.release(request_id)

    def _launched(self, batch: ScheduledBatch, result: StepResult) -> LaunchedStep:
        if result.greedy is not None:  # a decode-only graph step: no prefill, no prompt logprobs
            greedy = result.greedy
            cuda = greedy.is_cuda
            host = torch.empty(greedy.shape, dtype=greedy.dtype, pin_memory=cuda)
            host.copy_(greedy, non_blocking=cuda)
            copied = None
            if cuda:
                copied = torch.cuda.Event()
                copied.record()
            return LaunchedStep(batch, greedy=greedy, host=host, copied=copied)
        emitted = dict(result.chosen)
        logprobs: dict[str, tuple[TokenLogprobs, ...]] = {}
        if result.logits is not None:
            requests = {r.request_id: r for r in batch.requests}
            rows = [requests[rid] for rid in result.sample_ids]
            specs = [sampling_spec(r.sampling_params) for r in rows]
            histories = [r.token_history or ((), ()) for r in rows]
            sampled = self.sampler.sample_rows(
                result.logits, list(result.sample_ids), specs, histories
            )
            for rid, token, entry in zip(result.sample_ids, sampled.token_ids, sampled.logprobs):
                emitted[rid] = (token,)
                if entry is not None:
                    logprobs[rid] = (entry,)
        # after the sampler's copy: the prompt logprobs' own (steps with chunks that asked)
        prompt = result.prompt_logprobs.fetch() if result.prompt_logprobs is not None else {}
        self._check_step()  # the step's output was read on the host: its checks are complete
        output = StepOutput(tuple(
            RequestStepOutput(r.request_id, emitted.get(r.request_id, ()),
                              logprobs.get(r.request_id, ()), prompt.get(r.request_id, ()))
            for r in batch.requests
        ))  # fmt: skip
        return LaunchedStep(batch, output=output)
