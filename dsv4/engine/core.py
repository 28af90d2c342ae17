"""The engine loop body shared by both pools: schedule -> execute -> update, on ONE thread.

`EngineCore` is synchronous and not thread-safe; `dsv4.engine.async_engine.AsyncEngine` owns one on a
dedicated thread and bridges it to asyncio. Three ways a request enters:

- `add_request`: a whole request (colocated serving, `dsv4 generate`);
- `add_request(..., prefill_only=True)`: the prefill pool. When the prompt's last chunk samples
  the first token, the request's blocks are retained under a hold (`held`) so a decode worker
  can pull them; `release_hold` drops it (after the pull, or when the lease expires);
- `adopt` + `activate`: the decode pool. `adopt` allocates blocks for a pulled prompt and returns
  them in hand-off order; after the transfer lands, `activate` lets the request decode from its
  first token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from dsv4.cache.manager import KVCacheManager
from dsv4.cache.packing import CacheOptions
from dsv4.errors import ConfigError, InvalidRequest, OutOfBlocks, StepFailed
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.runner.model_runner import LaunchedStep, ModelRunner
from dsv4.runner.paged.collectives import ONE_RANK, PagedCollectives
from dsv4.runner.paged.step_forward import PagedOptions
from dsv4.runner.reference.forward import DEFAULT_REFERENCE, ReferenceOptions
from dsv4.runner.reference.slot_tables import DEFAULT_KERNELS
from dsv4.runner.step_forward import StepForward
from dsv4.scheduler.batch import RequestOutput, ScheduledBatch
from dsv4.scheduler.config import SchedulerConfig
from dsv4.scheduler.request import Request, StopChecker
from dsv4.scheduler.scheduler import Scheduler
from dsv4.types import SamplingParams
from kernels.backend import KernelBackendConfig

log = logging.getLogger(__name__)

STEP_KINDS = ("prefill", "graph", "eager")  # mixed/prefill steps; decode-only: replayed or not


@dataclass
class StepCounters:
    """Steps run and their host-timed seconds per kind (`STEP_KINDS`), read at scrape time.

    "graph" steps replayed a captured decode pass, "eager" decode-only steps did not (a batch
    or context past the largest bucket, graphs off): a decode pool serving "eager" steps under
    load has its graph buckets sized wrong. Written by the engine thread only."""

    steps: dict[str, int]
    seconds: dict[str, float]

    @classmethod
    def zero(cls) -> StepCounters:
        return cls(dict.fromkeys(STEP_KINDS, 0), dict.fromkeys(STEP_KINDS, 0.0))

    def add(self, kind: str, seconds: float) -> None:
        self.steps[kind] += 1
        self.seconds[kind] += seconds


@dataclass(frozen=True)
class HeldBlocks:
    """A finished prefill's blocks, kept for a KV pull (block ids in hand-off order)."""

    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token: int
    held_since_s: float


@dataclass(frozen=True)
class EngineLoad:
    """What the router and the registry read about a worker."""

    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    num_queued_prefill_tokens: int
    num_held: int


class EngineCore:
    def __init__(
        self, scheduler: Scheduler, runner: ModelRunner, vocab_size: int | None = None
    ) -> None:
        """`vocab_size`: the model's (logit_bias token ids are checked against it; None: not)."""
        self.scheduler = scheduler
        self.runner = runner
        self.vocab_size = vocab_size
        self.kv: KVCacheManager = scheduler.kv
        self._prefill_only: set[str] = set()
        self._adopted: dict[str, Request] = {}
        self.held: dict[str, HeldBlocks] = {}
        self.num_steps = 0
        self.num_preemptions = 0
        self.step_counters = StepCounters.zero()
        # features.async_scheduling: launch the next decode step before this one's tokens
        # are on the host (`Scheduler.schedule_ahead`, `ModelRunner.launch_ahead`)
        self.async_scheduling = False
        self._launched: LaunchedStep | None = None  # the step running ahead, to finish next
        self.num_steps_ahead = 0  # steps launched before the previous one's tokens were read
        # the requests of the step executing now (the step watchdog names them if it hangs;
        # read from another thread: replaced whole, never mutated)
        self.step_request_ids: tuple[str, ...] = ()

    # ---- requests in -----------------------------------------------------------------------
    def add_request(self, request: Request, *, prefill_only: bool = False) -> None:
        self._check_sampling(request)
        if prefill_only:
            request.max_new_tokens = 1
        self.scheduler.add_request(request)
        if prefill_only:
            self._prefill_only.add(request.request_id)

    def adopt(self, request: Request) -> tuple[int, ...]:
        """Allocate blocks for `request`'s pulled prompt KV; returns them in hand-off order.

        `request.output_token_ids` must hold the first token sampled by the prefill worker.
        Raises `OutOfBlocks` when the blocks are not free (nothing is taken then)."""
        rid = request.request_id
        self._check_sampling(request, prefills=False)  # its prompt's logprobs were P's
        if rid in self._adopted or self.scheduler.get_request(rid) is not None:
            raise InvalidRequest(f"request id {rid!r} is already in use")
        if len(request.output_token_ids) != 1:
            raise InvalidRequest(f"request {rid!r}: adopt needs exactly the first token")
        self.scheduler.check_fits(request)
        if waiting := self.scheduler.num_preempted_waiting:  # they have first claim on blocks
            raise OutOfBlocks(f"{waiting} preempted requests wait for KV blocks here")
        block_ids = self.kv.adopt(rid, request.num_prompt_tokens)
        self._adopted[rid] = request
        return block_ids

    def _check_sampling(self, request: Request, *, prefills: bool = True) -> None:
        """A speculating engine verifies drafts on logits as they are: penalties or a logit
        bias would change which drafts are right, so it refuses them instead of ignoring them;
        its verified tokens leave no logits row to read logprobs from, so it refuses those too,
        and prompt logprobs when it `prefills` the prompt (its forward runs a step's prefill
        chunks too, with the head on their sample rows only). logit_bias token ids must index
        the model's logits (the sampler adds at those ids)."""
        params = request.sampling_params
        if params is None:
            return
        k = self.scheduler.config.num_speculative_tokens
        prompt_logprobs = prefills and params.prompt_logprobs is not None
        if (params.needs_logits_processing or prompt_logprobs) and k:
            what = [name for name, on in (
                ("presence/frequency/repetition penalties", params.has_penalties),
                ("logit_bias", bool(params.logit_bias)),
                ("logprobs", params.logprobs is not None),
                ("prompt_logprobs", prompt_logprobs),
            ) if on]  # fmt: skip
            raise InvalidRequest(
                f"request {request.request_id!r}: speculative decoding (this worker drafts {k} "
                f"tokens) does not support {' or '.join(what)}; leave them unset or serve "
                "without --spec-method"
            )
        vocab = self.vocab_size
        outside = [t for t, _ in params.logit_bias if vocab is not None and not 0 <= t < vocab]
        if outside:
            raise InvalidRequest(
                f"request {request.request_id!r}: logit_bias token id {outside[0]} is outside "
                f"the vocabulary: token ids must be in [0, {vocab})"
            )

    def activate(self, request_id: str) -> None:
        """The pulled KV has landed: decode from the first token."""
        request = self._adopted.pop(request_id)
        self.scheduler.add_adopted(request)

    def abandon(self, request_id: str) -> None:
        """An adopted request whose pull failed or was cancelled: free its blocks."""
        if self._adopted.pop(request_id, None) is not None:
            self.kv.free(request_id)

    def abort(self, request_id: str) -> bool:
        """Abort wherever the request is (queued, running, adopted, or held after prefill)."""
        found = self.scheduler.abort(request_id)
        self._prefill_only.discard(request_id)
        if request_id in self._adopted:
            self.abandon(request_id)
            found = True
        return self.release_hold(request_id) or found

    def release_hold(self, request_id: str) -> bool:
        held = self.held.pop(request_id, None)
        if held is None:
            return False
        self.kv.release(held.block_ids)
        return True

    # ---- the step --------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._launched is not None

    @property
    def has_step_in_flight(self) -> bool:
        """A step launched ahead runs on the device (async scheduling): `drain` before
        anything writes blocks outside the device stream (a KV pull into adopted blocks)."""
        return self._launched is not None

    def step(self, ahead: bool = True) -> list[RequestOutput]:
        """One schedule -> execute -> update. With async scheduling a step launched by the
        previous call is finished here instead, after the next one is launched behind it
        (`ahead` False: launch none, e.g. `drain`). If anything raises, only the requests of
        the steps in flight fail: they are aborted (blocks, holds freed), the in-flight
        batches dropped so the next step schedules afresh, and `StepFailed` names them."""
        launched, self._launched = self._launched, None
        batch = launched.batch if launched is not None else self.scheduler.schedule()
        if batch.is_empty:
            return []
        request_ids = [r.request_id for r in batch.requests]
        self.step_request_ids = tuple(request_ids)
        try:
            return self._execute(batch, launched, ahead, request_ids)
        except Exception as exc:
            self._launched = None
            self.scheduler.discard_in_flight()
            request_ids = list(dict.fromkeys(request_ids))
            for rid in request_ids:
                self.abort(rid)
            raise StepFailed(
                f"engine step failed ({type(exc).__name__}: {exc}); ended the "
                f"{len(request_ids)} requests of that step",
                tuple(request_ids),
            ) from exc

    def drain(self) -> list[RequestOutput]:
        """Finish the step launched ahead, if any, launching none behind it."""
        return self.step(ahead=False) if self._launched is not None else []

    def discard_in_flight(self) -> None:
        """Forget every scheduled or launched step (after a failure outside any step)."""
        self._launched = None
        self.scheduler.discard_in_flight()

    def _execute(self, batch: ScheduledBatch, launched: LaunchedStep | None, ahead: bool,
                 request_ids: list[str]) -> list[RequestOutput]:  # fmt: skip
        if batch.preempted_request_ids:  # KV blocks ran out: recomputed when blocks free up
            self.num_preemptions += len(batch.preempted_request_ids)
            log.info("preempted %s: out of KV blocks", ", ".join(batch.preempted_request_ids))
        replays = self.runner.num_graph_replays
        started = time.perf_counter()
        if not self.async_scheduling:  # `execute` (rank 0's runner also sends the step)
            output = self.runner.execute(batch)
        else:
            if launched is None:
                launched = self.runner.launch(batch)
            if ahead and launched.greedy is not None:
                self._launched = self._launch_ahead(launched)
                if self._launched is not None:
                    request_ids += (r.request_id for r in self._launched.batch.requests)
            output = self.runner.finish(launched)  # greedy graph tokens: the one sync
        kind = "prefill" if batch.prefills else "eager"
        on_graph = launched is not None and launched.greedy is not None  # launched earlier
        if self.runner.num_graph_replays != replays or on_graph:
            kind = "graph"
        self.step_counters.add(kind, time.perf_counter() - started)
        self.num_steps += 1
        # Retain finished prefills' blocks before update() frees the requests.
        sampled = {o.request_id: o.new_token_ids for o in output.outputs if o.new_token_ids}
        for req in batch.requests:
            rid = req.request_id
            if rid in self._prefill_only and req.samples_token and rid in sampled:
                self.held[rid] = HeldBlocks(
                    rid, self.kv.retain(rid), req.end_position, sampled[rid][0], time.monotonic()
                )
                self._prefill_only.discard(rid)
        return self.scheduler.update(output)

    def _launch_ahead(self, previous: LaunchedStep) -> LaunchedStep | None:
        """Schedule and launch the step after `previous` while it runs (None: not this time)."""
        batch = self.scheduler.schedule_ahead()
        if batch is None:
            return None
        launched = self.runner.launch_ahead(batch, previous)
        if launched is None:
            self.scheduler.discard_ahead()
        else:
            self.num_steps_ahead += 1
        return launched

    def warm_up(self, prompt_lengths: Sequence[int], num_new_tokens: int = 4,
                mixed_lengths: Sequence[int] = ()) -> None:  # fmt: skip
        """Serve throw-away requests (one per prompt length, one after another) before the
        worker takes traffic, so that kernel compilation and autotuning land here and not in
        a client's TTFT. The first request samples (temperature, top-k, top-p, no seed) so the
        batched sampler's kernels build here too (FlashInfer JIT-compiles its sampling module
        on first use: ~1.5 min on a fresh host); the rest are greedy.

        `mixed_lengths` (a colocated worker's): each such prompt is admitted while another
        request decodes, so the mixed prefill + decode steps of chunked prefill compile here as
        well (on the H200 e2e run, the first colocated prompts that joined a decoding batch
        took 2.2 s to their first token, 0.07 s later). Leaves nothing behind (checked)."""
        sampled = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
        for n, length in enumerate(prompt_lengths):
            self._add_warm_up(
                f"__warm_up_{n}__", length, num_new_tokens, sampled if n == 0 else None
            )
            self._run_until_idle()
        for n, length in enumerate(mixed_lengths):
            self._add_warm_up(f"__warm_up_decoding_{n}__", 16, 8)
            self.step()  # its prefill: from the next step on it decodes beside the prompt below
            self._add_warm_up(f"__warm_up_mixed_{n}__", length, 2)
            self._run_until_idle()
        leaks = self.find_leaks()
        assert not leaks, leaks

    def _add_warm_up(self, request_id: str, length: int, num_new_tokens: int,
                     sampling: SamplingParams | None = None) -> None:  # fmt: skip
        prompt = tuple(2 + i % 97 for i in range(max(1, length)))
        self.add_request(Request(request_id, prompt, max_new_tokens=num_new_tokens,
                                 eos_token_id=None, sampling_params=sampling))  # fmt: skip

    def _run_until_idle(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.has_work():
                return
            self.step()

    # ---- introspection -----------------------------------------------------------------------
    def load(self) -> EngineLoad:
        sched = self.scheduler
        queued = sum(
            r.num_uncomputed_tokens
            for r in (sched.get_request(rid) for rid in sched.request_ids())
            if r is not None and not r.is_decoding
        )
        return EngineLoad(
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_blocks,
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            num_queued_prefill_tokens=queued,
            num_held=len(self.held),
        )

    def find_leaks(self) -> list[str]:
        leaks = self.scheduler.find_leaks()
        if self.held:
            leaks.append(f"{len(self.held)} prefill holds: {sorted(self.held)[:8]}")
        if self._adopted:
            leaks.append(f"{len(self._adopted)} adopted requests never activated")
        if self._launched is not None:
            leaks.append("a step launched ahead was never finished")
        return leaks


@dataclass(frozen=True)
class EngineOptions:
    """What one model replica's engine is built with (`build_engine_core`)."""

    cache: CacheOptions
    scheduler: SchedulerConfig
    num_blocks: int
    device: str = "cpu"
    kernels: KernelBackendConfig = DEFAULT_KERNELS
    # None: the reference forward (the oracle), with `reference`'s state loading; else the
    # paged forward with these switches (and decode graphs when `paged.graphs` is set)
    paged: PagedOptions | None = None
    reference: ReferenceOptions = DEFAULT_REFERENCE
    # False keeps every row on the row-by-row CPU sampler (the slow path of
    # `features.batched_sampling`); True batches unseeded rows on CUDA (`Sampler`)
    batched_sampling: bool = True
    # count routed expert selections per MoE layer on the device (`runner.routing_stats`)
    routing_stats: bool = False
    # features.async_scheduling: schedule and launch the next greedy decode graph step while
    # the current one runs (needs `paged.graphs` with greedy_argmax; else nothing runs ahead)
    async_scheduling: bool = False


def build_engine_core(
    model: DeepseekV4,
    options: EngineOptions,
    stop_checker: StopChecker | None = None,
    collectives: PagedCollectives = ONE_RANK,
) -> EngineCore:
    """Runner (`build_model_runner`), KV manager -> scheduler, for one model replica (on a
    sharded replica: rank 0's, `collectives` its hooks)."""
    from dsv4.cache.layout import KVLayout

    cache_options, scheduler_config = options.cache, options.scheduler
    if cache_options.num_speculative_tokens != scheduler_config.num_speculative_tokens:
        raise ConfigError(
            "num_speculative_tokens",
            scheduler_config.num_speculative_tokens,
            f"the cache reserves {cache_options.num_speculative_tokens} draft slots: use the same k",
        )
    runner = build_model_runner(model, options, collectives)
    kv = KVCacheManager(KVLayout.build(model.cfg, cache_options), options.num_blocks)
    scheduler = Scheduler(scheduler_config, kv, stop_checker=stop_checker)
    core = EngineCore(scheduler, runner, vocab_size=model.cfg.vocab_size)
    core.async_scheduling = options.async_scheduling
    return core


def build_model_runner(
    model: DeepseekV4, options: EngineOptions, collectives: PagedCollectives = ONE_RANK
) -> ModelRunner:
    """Layout -> paged cache -> forward + sampler -> runner: what every rank of a replica builds
    from the same `options` (rank 0's, sent to the followers), each on its shard with its
    `collectives`. With `options.paged.graphs` the decode step's passes are captured (or run
    as static eager steps) before the runner is returned; on a sharded replica every rank
    captures at once (the captured all-reduces pair up)."""
    from dsv4.cache.layout import KVLayout
    from dsv4.runner.kv_cache import PagedKVCache
    from dsv4.runner.paged.decode_graphs import DecodeGraphs, num_scratch_blocks
    from dsv4.runner.paged.forward import PagedForward
    from dsv4.runner.paged.step_forward import PagedStepForward
    from dsv4.runner.reference.forward import ReferenceForward
    from dsv4.runner.routing_stats import RoutingStats
    from dsv4.runner.sampler import Sampler

    layout = KVLayout.build(model.cfg, options.cache)
    paged = options.paged
    graph_options = None if paged is None else paged.graphs
    if graph_options is not None and graph_options.capture and not collectives.can_capture:
        raise ConfigError("features.cuda_graphs", True, "these ranks' collectives (gloo) "
                          "cannot be captured: turn graphs off or use nccl")  # fmt: skip
    scratch = num_scratch_blocks(layout) if graph_options is not None else 0
    cache = PagedKVCache(layout, options.num_blocks, device=options.device,
                         num_scratch_blocks=scratch)  # fmt: skip
    sampler = Sampler(batched=None if options.batched_sampling else False)
    stats = RoutingStats.for_model(model, options.num_blocks) if options.routing_stats else None
    forward: StepForward
    if paged is None:
        forward = ReferenceForward(model, cache, sampler, options.reference)
        if stats is not None:
            stats.observe(model)
    else:
        flat = PagedForward(model, cache, options.kernels, paged.metadata, paged.switches,
                            collectives)  # fmt: skip
        flat.routing_stats = stats  # before the capture: graphs count too
        graphs = None
        if graph_options is not None:
            graphs = DecodeGraphs(flat, cache, graph_options, options.cache.num_speculative_tokens)
            graphs.capture()
        forward = PagedStepForward(flat, sampler, graphs)
    runner = ModelRunner(forward, sampler, cache)
    runner.routing_stats = stats
    return runner
