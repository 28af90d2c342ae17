"""The reference (oracle) forward: the model over per-request states loaded from the paged cache.

Decodes (one token each) run as one batched forward; each prefill chunk runs as its own row
(rows of one forward must have equal lengths). Every request's state is loaded from the paged
cache (`cache_state`), advanced by `DeepseekV4.forward`, and its changes stored back, so the
cache alone carries a request between steps (and between workers, after a KV hand-off).

With MTP speculation on (the layout reserves draft slots and the model has an MTP layer) the
decodes go to this forward's speculative half, `speculative.SpeculativeDecoder` (draft,
verify 1 + k positions in one forward per row, accept, store only the accepted positions), and
prefill chunks hand their final streams to it for the MTP layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.errors import ConfigError
from dsv4.model.deepseek_v4 import DeepseekV4, ModelOutput
from dsv4.ops.hyper import hc_head
from dsv4.runner.kv_cache import PagedKVCache
from dsv4.runner.prompt_logprobs import StepPromptLogprobs
from dsv4.runner.reference.cache_state import load_state, load_states, store_state
from dsv4.runner.reference.slot_tables import (
    DEFAULT_KERNELS,
    DEFAULT_SLOT_TABLE_OPTIONS,
    SlotTableOptions,
)
from dsv4.runner.reference.speculative import SpeculativeDecoder
from dsv4.runner.sampler import Sampler
from dsv4.runner.step_forward import StepResult, check_speculation, sampling_spec
from dsv4.scheduler.batch import ScheduledBatch, ScheduledRequest
from dsv4.speculative.metrics import SpecMetrics
from kernels.backend import KernelBackendConfig


@dataclass(frozen=True)
class ReferenceOptions:
    """How the reference forward loads states. `shared_slot_tables`: None addresses each
    request's rows one by one (the reference); True gathers through slot tables built once
    per step for all layers (#45863); False rebuilds them for every layer (that PR's
    baseline)."""

    shared_slot_tables: bool | None = None
    kernels: KernelBackendConfig = DEFAULT_KERNELS
    slot_tables: SlotTableOptions = DEFAULT_SLOT_TABLE_OPTIONS


DEFAULT_REFERENCE = ReferenceOptions()


class ReferenceForward:
    """A `StepForward`; owned by the `ModelRunner` (engine thread)."""

    num_graph_replays = 0  # never captured

    def __init__(
        self,
        model: DeepseekV4,
        cache: PagedKVCache,
        sampler: Sampler,
        options: ReferenceOptions = DEFAULT_REFERENCE,
        *,
        num_speculative_tokens: int | None = None,
    ) -> None:
        """`num_speculative_tokens` (default: the layout's draft slots) > 0 turns MTP on; the
        speculative half samples with `sampler` (rejection sampling)."""
        self.model, self.cache, self.options = model, cache, options
        self.device = model.embed.weight.device
        self.dtype = model.embed.weight.dtype
        k = check_speculation(model, cache, num_speculative_tokens)
        self.spec = SpeculativeDecoder(model, cache, sampler, k) if k else None

    @property
    def spec_metrics(self) -> SpecMetrics | None:
        return None if self.spec is None else self.spec.metrics

    def run(self, batch: ScheduledBatch) -> StepResult:
        if self.spec is not None:
            for request_id in (*batch.finished_request_ids, *batch.preempted_request_ids):
                self.spec.release(request_id)
        chosen: dict[str, tuple[int, ...]] = {}
        logits: dict[str, torch.Tensor] = {}  # request -> last-position logits [V]
        prompt = StepPromptLogprobs.of(batch, self._head_logits)
        decodes = batch.decodes
        if decodes and self.spec is not None:
            specs = [sampling_spec(r.sampling_params) for r in decodes]
            chosen.update(self.spec.decode(decodes, specs))
        elif decodes:
            if any(r.num_draft_tokens for r in decodes):
                raise ConfigError("num_speculative_tokens", "> 0", "the runner has MTP off")
            logits.update(self._forward(decodes))
        for prefill in batch.prefills:
            out = self._run((prefill,))
            logits[prefill.request_id] = out.logits[0, -1]
            if prompt is not None:  # the chunk's rows predict its prompt targets
                prompt.add(prefill, out.streams[0])  # [S, M, D]
        sampled = [r for r in batch.requests if r.samples_token and r.request_id in logits]
        if not sampled:
            return StepResult(chosen=chosen, prompt_logprobs=prompt)
        stacked = torch.stack([logits[r.request_id] for r in sampled])  # [B, V]
        return StepResult(
            stacked, tuple(r.request_id for r in sampled), chosen, prompt_logprobs=prompt
        )

    def _head_logits(self, streams: torch.Tensor) -> torch.Tensor:
        """Final streams [R, M, D] -> logits [R, V] fp32: the model's head, as its forward."""
        m, cfg = self.model, self.model.cfg
        h = hc_head(streams, m.hc_head_fn, m.hc_head_scale, m.hc_head_base, cfg.hc_eps,
                    cfg.rms_norm_eps)  # fmt: skip
        return m.head(m.norm(h)).float()

    def _forward(self, requests: tuple[ScheduledRequest, ...]) -> dict[str, torch.Tensor]:
        """Rows of equal length -> last-position logits [V] per request."""
        out = self._run(requests)
        return {r.request_id: out.logits[i, -1] for i, r in enumerate(requests)}

    def _run(self, requests: tuple[ScheduledRequest, ...]) -> ModelOutput:
        opts = self.options
        if opts.shared_slot_tables is None:
            states = [load_state(self.cache, r, self.dtype) for r in requests]
        else:
            states = load_states(
                self.cache,
                requests,
                self.dtype,
                shared_metadata=opts.shared_slot_tables,
                kernels=opts.kernels,
                options=opts.slot_tables,
            )
        ids = torch.tensor([r.token_ids for r in requests], dtype=torch.long, device=self.device)
        out = self.model(ids, states=states, last_only=True)
        for row, (req, state) in enumerate(zip(requests, states)):
            store_state(self.cache, req, state, req.start_position, req.end_position)
            if self.spec is not None:
                self.spec.observe(req, out.streams[row])  # [S, M, D] for the MTP layer
        return out
