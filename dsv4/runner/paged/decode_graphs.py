"""The decode step's static passes over one paged forward (`graphs.StaticPass` each):

- `target`: the model over q = 1 + k tokens per request (the last token and k drafts; k = 0
  without MTP) -> logits [B * q, V] and final streams [B * q, M, D];
- `mtp`: the MTP layer over a request's q = 1 + k verified positions (the target's streams, the
  next tokens), logits of one selected row per request -> the first draft;
- `mtp_draft`: the MTP layer over one position per request (its own streams) -> the next draft.

`run_*` return None when a step does not fit (not decode-only, a batch or a context past the
largest bucket): the caller then runs the eager forward. Owned by the runner (engine thread).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4.runner.kv_cache import PagedKVCache
from dsv4.runner.paged.forward import PagedForward
from dsv4.runner.paged.graphs import (
    StaticInputs,
    StaticPass,
    StepRow,
    batch_buckets,
    context_buckets,
    graph_max_end,
    max_blocks_for,
)
from dsv4.runner.paged.step_metadata import StepMetadata
from dsv4.scheduler.batch import ScheduledRequest


@dataclass(frozen=True)
class GraphOptions:
    max_batch: int  # largest captured batch (vLLM's max capture size)
    max_model_len: int
    capture: bool = True  # CUDA graphs; False runs the static steps eagerly (CPU, tests)
    batches: tuple[int, ...] = ()  # default: batch_buckets(max_batch)
    contexts: tuple[int, ...] = ()  # default: context_buckets(...)
    # the target pass also writes argmax(logits) [B * q] int64 (features.greedy_in_graph):
    # an all-greedy step then copies back B token ids, no sampler launch (`target_tokens`)
    greedy_argmax: bool = False


def num_scratch_blocks(layout) -> int:
    """Scratch blocks a cache needs for graph padding rows: one token block + the ring blocks."""
    return 1 + layout.num_ring_blocks


class DecodeGraphs:
    def __init__(self, forward: PagedForward, cache: PagedKVCache, options: GraphOptions,
                 num_speculative_tokens: int = 0) -> None:  # fmt: skip
        layout = cache.layout
        cfg = layout.model
        if len(cache.scratch_block_ids) < num_scratch_blocks(layout):
            raise ValueError("the cache needs num_scratch_blocks(layout) scratch blocks")
        self.forward, self.k = forward, num_speculative_tokens
        self.greedy_argmax = options.greedy_argmax
        self.query_len = 1 + num_speculative_tokens
        max_end = graph_max_end(options.max_model_len, self.query_len)
        batches = options.batches or batch_buckets(options.max_batch)
        contexts = options.contexts or context_buckets(max_end, cfg.index_topk)
        self.max_blocks = max_blocks_for(contexts[-1], layout.block_size)
        dev, dtype = forward.device, forward.model.embed.weight.dtype
        streams_shape = (cfg.hc_mult, cfg.hidden_size)
        scratch, nr = cache.scratch_block_ids, layout.num_ring_blocks

        def inputs(q: int) -> StaticInputs:
            return StaticInputs(batches[-1], q, self.max_blocks, scratch, nr, dev)

        target = StaticPass(self._target, inputs(self.query_len), batches, contexts, None, dtype,
                            options.capture)  # fmt: skip
        self.passes = {"target": target}
        if num_speculative_tokens:
            mtp_inputs = inputs(self.query_len)
            self.passes["mtp"] = StaticPass(self._mtp, mtp_inputs, batches, contexts,
                                            streams_shape, dtype, options.capture)  # fmt: skip
            if num_speculative_tokens > 1:
                self.passes["mtp_draft"] = StaticPass(self._mtp, inputs(1), batches, contexts,
                                                      streams_shape, dtype, options.capture)  # fmt: skip

    # ---- the captured functions --------------------------------------------------------------
    def _meta(self, shape, t) -> StepMetadata:
        f = self.forward
        return StepMetadata(shape, None, t, f.geo, f.kernels, f.metadata)

    def _target(self, shape, t, select, streams):
        logits, out = self.forward.run(self._meta(shape, t))
        if not self.greedy_argmax:
            return logits, out
        # the sampler's greedy choice, same op on the same fp32 logits: ties to the lowest id
        return logits, out, logits.argmax(dim=-1)  # [B * q] int64

    def _mtp(self, shape, t, select, streams):
        return self.forward.run_mtp(self._meta(shape, t), streams, select)

    # ---- lifecycle ---------------------------------------------------------------------------
    def capture(self) -> None:
        """Warm up (autotuning on full-context padding rows) and capture every pass and key,
        all sharing one memory pool. Called once, before the engine serves."""
        pool = None
        for p in self.passes.values():
            pool = p.capture(pool)
        if self.forward.device.type == "cuda":
            torch.cuda.synchronize(self.forward.device)

    @property
    def num_graphs(self) -> int:
        return sum(len(p.graphs) for p in self.passes.values())

    # ---- steps -------------------------------------------------------------------------------
    def run_target(self, requests: Sequence[ScheduledRequest],
                   drafts: dict[str, tuple[int, ...]],
                   previous: tuple[torch.Tensor, Sequence[int]] | None = None,
                   ) -> tuple[torch.Tensor, ...] | None:  # fmt: skip
        """Decode-only steps: (logits [B * q, V] fp32, streams [B * q, M, D][, greedy tokens
        [B * q] int64 with `greedy_argmax`]) with each request's
        token then its drafts padded to k (padding positions are rejected by the caller; past a
        request's blocks they land in the scratch block). None: run eagerly.
        `previous` (async scheduling, k = 0): (the last step's greedy tokens [B'] on the
        device, the row of each request there): the requests' tokens come from it."""
        q = self.query_len
        if not requests or any(r.is_prefill or r.num_tokens != 1 for r in requests):
            return None
        if any(r.num_draft_tokens > self.k for r in requests):
            return None
        key = self.passes["target"].key_for(
            len(requests), max(r.start_position for r in requests) + q
        )
        if key is None:
            return None
        rows = []
        prev_rows = previous[1] if previous is not None else [-1] * len(requests)
        for r, prev in zip(requests, prev_rows):
            found = drafts.get(r.request_id, ())[: r.num_draft_tokens]
            ids = (r.token_ids[0], *found, *([0] * (q - 1 - len(found))))
            rows.append(StepRow(ids, r.start_position, r.block_table, r.ring_block_ids,
                                prev_row=prev))  # fmt: skip
        tokens = None if previous is None else previous[0]
        outputs = self.passes["target"].run(key, rows, previous=tokens)
        n = len(requests) * q
        return tuple(t[:n] for t in outputs)

    def target_tokens(self, outputs: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        """The in-graph greedy tokens [B * q] int64 (device) of a `run_target` result, None
        when the pass does not compute them (`GraphOptions.greedy_argmax` off)."""
        return outputs[2] if self.greedy_argmax else None

    def run_mtp(self, name: str, rows: Sequence[StepRow],
                streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """An MTP pass ("mtp": q = 1 + k positions per row; "mtp_draft": q = 1) -> (logits of
        each row's selected position [B, V], post-block streams [B * q, M, D]); None: eager."""
        p = self.passes.get(name)
        if p is None or not rows:
            return None
        q = p.inputs.query_len
        key = p.key_for(len(rows), max(r.start for r in rows) + q)
        if key is None:
            return None
        logits, out = p.run(key, rows, streams)
        return logits[: len(rows)], out[: len(rows) * q]
