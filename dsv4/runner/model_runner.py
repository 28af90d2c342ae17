"""Execute one `ScheduledBatch` on the model over the paged cache and sample.

Decodes (one token each) run as one batched forward; each prefill chunk runs as its own row
(rows of one forward must have equal lengths). Every request's state is loaded from the paged
cache, advanced by the model, and its changes stored back, so the cache alone carries a request
between steps (and between workers, after a KV hand-off).

With MTP speculation on (the layout reserves draft slots and the model has an MTP layer) the
decodes go to `dsv4.speculative.SpeculativeDecoder` instead (draft, verify 1 + k positions in one
forward per row, accept, store only the accepted positions), and prefill chunks hand their
final streams to it for the MTP layer.

With `paged` set (a `dsv4.runner.paged.PagedForward`, the GPU serving path) every step runs as
one flat forward on the cache through the kernels instead; decode-only steps replay the
captured graphs of `graphs` (a `DecodeGraphs`) when given, and MTP speculation runs as
`dsv4.speculative.paged.PagedSpeculator` (verify, accept, propose with the MTP layer on the cache).
"""

from __future__ import annotations

import torch

from dsv4.errors import ConfigError
from dsv4.model.deepseek_v4 import DeepseekV4, ModelOutput
from dsv4.ops.sampling import SamplingSpec
from dsv4.runner.metadata import DEFAULT_KERNELS, DEFAULT_METADATA_OPTIONS, MetadataOptions
from dsv4.runner.paged_cache import PagedKVCache
from dsv4.runner.paged_state import load_state, load_states, store_state
from dsv4.runner.sampler import Sampler
from dsv4.scheduler.batch import RequestStepOutput, ScheduledBatch, ScheduledRequest, StepOutput
from dsv4.speculative.decoder import SpeculativeDecoder
from dsv4.speculative.metrics import SpecMetrics
from dsv4.speculative.paged import PagedSpeculator
from kernels.backend import KernelBackendConfig


def sampling_spec(params: object) -> SamplingSpec:
    """The sampler's view of a request's sampling parameters (any object with the fields)."""
    if params is None:
        return SamplingSpec()
    if isinstance(params, SamplingSpec):
        return params
    return SamplingSpec(
        temperature=float(getattr(params, "temperature", 0.0) or 0.0),
        top_p=float(getattr(params, "top_p", 1.0) or 1.0),
        top_k=int(getattr(params, "top_k", 0) or 0),
        seed=getattr(params, "seed", None),
    )


class ModelRunner:
    def __init__(
        self,
        model: DeepseekV4,
        cache: PagedKVCache,
        sampler: Sampler | None = None,
        *,
        num_speculative_tokens: int | None = None,
        shared_metadata: bool | None = None,
        kernels: KernelBackendConfig = DEFAULT_KERNELS,
        metadata_options: MetadataOptions = DEFAULT_METADATA_OPTIONS,
        paged: object = None,
        graphs: object = None,
    ):
        """`num_speculative_tokens` (default: the layout's draft slots) > 0 turns MTP on.

        `shared_metadata`: None loads each request's state by per-request addressing (the
        reference); True gathers through slot tables built once per step for all layers
        (#45863); False rebuilds them for every layer (that PR's baseline)."""
        self.shared_metadata = shared_metadata
        self.kernels = kernels
        self.metadata_options = metadata_options
        self.model = model
        self.cache = cache
        self.sampler = sampler or Sampler()
        self.device = model.embed.weight.device
        self.dtype = model.embed.weight.dtype
        k = cache.layout.options.num_speculative_tokens
        k = k if num_speculative_tokens is None else num_speculative_tokens
        self.spec: SpeculativeDecoder | PagedSpeculator | None = None
        self.paged = paged
        self.graphs = graphs
        if graphs is not None and paged is None:
            raise ConfigError("features.cuda_graphs", True, "graphs capture the paged forward")
        if k:
            if not len(model.mtp):
                raise ConfigError("num_speculative_tokens", k, "the model has no MTP layer; use 0")
            if paged is not None:
                self.spec = PagedSpeculator(paged, self.sampler, k, graphs)
            else:
                self.spec = SpeculativeDecoder(model, cache, self.sampler, k)

    @property
    def num_graph_replays(self) -> int:
        """Target-pass replays so far (0 without graphs): tells graph steps from eager ones."""
        return 0 if self.graphs is None else self.graphs.passes["target"].num_runs

    @property
    def spec_metrics(self) -> SpecMetrics | None:
        """Drafted / accepted counts per draft position (None without speculation)."""
        return None if self.spec is None else self.spec.metrics

    @torch.no_grad()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        for request_id in batch.finished_request_ids:
            self.sampler.release(request_id)
        if self.spec is not None:
            for request_id in (*batch.finished_request_ids, *batch.preempted_request_ids):
                self.spec.release(request_id)
        if self.paged is not None:
            return self._execute_paged(batch)
        emitted: dict[str, tuple[int, ...]] = {}
        logits: dict[str, torch.Tensor] = {}
        decodes = batch.decodes
        if decodes and self.spec is not None:
            specs = [sampling_spec(r.sampling_params) for r in decodes]
            emitted.update(self.spec.decode(decodes, specs))
        elif decodes:
            if any(r.num_draft_tokens for r in decodes):
                raise ConfigError("num_speculative_tokens", "> 0", "the runner has MTP off")
            logits.update(self._forward(decodes))
        for prefill in batch.prefills:
            logits.update(self._forward((prefill,)))
        sampled = [r for r in batch.requests if r.samples_token and r.request_id in logits]
        if sampled:
            stacked = torch.stack([logits[r.request_id] for r in sampled])  # [B, V]
            ids = [r.request_id for r in sampled]
            specs = [sampling_spec(r.sampling_params) for r in sampled]
            tokens = self.sampler.sample(stacked, ids, specs)
            emitted.update((rid, (token,)) for rid, token in zip(ids, tokens))
        return StepOutput(
            tuple(
                RequestStepOutput(r.request_id, emitted.get(r.request_id, ()))
                for r in batch.requests
            )
        )

    def _execute_paged(self, batch: ScheduledBatch) -> StepOutput:
        emitted: dict[str, tuple[int, ...]] = {}
        if batch.requests and isinstance(self.spec, PagedSpeculator):
            specs = {r.request_id: sampling_spec(r.sampling_params) for r in batch.requests}
            emitted = self.spec.step(batch, specs)
        elif batch.requests:
            out = None
            if self.graphs is not None and not batch.prefills:
                out = self.graphs.run_target(batch.requests, {})  # (logits [B, V], streams)
            logits = out[0] if out is not None else self.paged(batch).logits  # [sampling, V]
            sampled = [r for r in batch.requests if r.samples_token]
            ids = [r.request_id for r in sampled]
            specs = [sampling_spec(r.sampling_params) for r in sampled]
            tokens = self.sampler.sample(logits, ids, specs)
            emitted.update((rid, (token,)) for rid, token in zip(ids, tokens))
        return StepOutput(
            tuple(
                RequestStepOutput(r.request_id, emitted.get(r.request_id, ()))
                for r in batch.requests
            )
        )

    def _forward(self, requests: tuple[ScheduledRequest, ...]) -> dict[str, torch.Tensor]:
        """Rows of equal length -> last-position logits [V] per request."""
        out = self._run(requests)
        return {r.request_id: out.logits[i, -1] for i, r in enumerate(requests)}

    def _run(self, requests: tuple[ScheduledRequest, ...]) -> ModelOutput:
        if self.shared_metadata is None:
            states = [load_state(self.cache, r, self.dtype) for r in requests]
        else:
            states = load_states(
                self.cache,
                requests,
                self.dtype,
                shared_metadata=self.shared_metadata,
                kernels=self.kernels,
                options=self.metadata_options,
            )
        ids = torch.tensor([r.token_ids for r in requests], dtype=torch.long, device=self.device)
        out = self.model(ids, states=states, last_only=True)
        for row, (req, state) in enumerate(zip(requests, states)):
            store_state(self.cache, req, state, req.start_position, req.end_position)
            if self.spec is not None:
                self.spec.observe(req, out.streams[row])  # [S, M, D] for the MTP layer
        return out
