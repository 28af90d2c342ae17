"""The MTP layer's passes on the paged cache (docs/model.md#mtp): catch-up, then draft steps.

MTP position j reads the final streams at j (the target's for verified positions, the MTP's
own for draft steps) and the token at j + 1; its window row goes into the MTP ring (layer id
num_hidden_layers) and its output predicts the token at j + 2. The layer is window-only, so a
pass runs like a decode step: every token's row is stored, then each token attends on the ring
(its window, rows of this pass included).

- `CatchUp` items: the positions whose next token became known this step (a decode's verified
  P..P+a, a prefill chunk's tail). Their rows are what later queries read; only the last
  position's output matters (it drafts d_1).
- draft steps: one position per request, on the MTP's own streams and the last draft.

Both run through the captured graphs (`DecodeGraphs`) when every item has the decode shape
(q = 1 + k positions), else eagerly as an ad-hoc step of `ScheduledRequest`s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4.runner.paged.decode_graphs import DecodeGraphs
from dsv4.runner.paged.forward import PagedForward
from dsv4.runner.paged.graphs import StepRow
from dsv4.runner.paged.step_metadata import StepMetadata, StepTokens, upload
from dsv4.scheduler.batch import ScheduledRequest


@dataclass(frozen=True)
class CatchUp:
    """MTP positions start..start+n-1 of one request: next_ids [n] and target streams [n, M, D].

    `select`: which position's output drafts (the last verified one); positions after it (a
    decode's rejected tail, kept so that every decode item has q = 1 + k positions) store rows
    that later passes overwrite before anything reads them."""

    request: ScheduledRequest
    start: int
    next_ids: tuple[int, ...]
    streams: torch.Tensor
    select: int


def _as_request(r: ScheduledRequest, start: int, ids: Sequence[int]) -> ScheduledRequest:
    """An MTP pass row as a decode-shaped request (attends on the cache after storing)."""
    return ScheduledRequest(r.request_id, tuple(ids), start, False, 0, True, r.block_table,
                            r.ring_block_ids)  # fmt: skip


class MTPPasses:
    def __init__(self, forward: PagedForward, graphs: DecodeGraphs | None, k: int) -> None:
        self.forward, self.graphs, self.k = forward, graphs, k

    def catch_up(self, items: Sequence[CatchUp]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits [n_items, V] of each item's selected position, its streams [n, M, D])."""
        q = 1 + self.k
        if self.graphs is not None and all(len(it.next_ids) == q for it in items):
            rows = [StepRow(it.next_ids, it.start, it.request.block_table,
                            it.request.ring_block_ids, it.select) for it in items]  # fmt: skip
            streams = torch.cat([it.streams for it in items])
            out = self.graphs.run_mtp("mtp", rows, streams)
            if out is not None:
                logits, x = out
                picks = torch.tensor([i * q + it.select for i, it in enumerate(items)])
                return logits, x[picks.to(x.device)]
        return self._eager(items)

    def draft_step(self, requests: Sequence[ScheduledRequest], positions: Sequence[int],
                   tokens: Sequence[int], streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """One draft step: request i at MTP position positions[i] with its last draft and its
        streams [B, M, D] -> (logits [B, V], streams [B, M, D])."""
        if self.graphs is not None:
            rows = [StepRow((tok,), p, r.block_table, r.ring_block_ids)
                    for r, p, tok in zip(requests, positions, tokens)]  # fmt: skip
            out = self.graphs.run_mtp("mtp_draft", rows, streams)
            if out is not None:
                return out
        items = [CatchUp(r, p, (tok,), streams[i : i + 1], 0)
                 for i, (r, p, tok) in enumerate(zip(requests, positions, tokens))]  # fmt: skip
        return self._eager(items)

    def _eager(self, items: Sequence[CatchUp]) -> tuple[torch.Tensor, torch.Tensor]:
        reqs = tuple(_as_request(it.request, it.start, it.next_ids) for it in items)
        tokens = StepTokens.of(reqs)
        ids = [t for r in reqs for t in r.token_ids]
        f = self.forward
        t = upload(tokens, ids, f.device)
        firsts = tokens.first_token
        rows = tuple(firsts[i] + it.select for i, it in enumerate(items))
        shape = dataclasses.replace(tokens.shape, sample_rows=rows)
        meta = StepMetadata(shape, tokens, t, f.geo, f.kernels, f.metadata)
        streams = torch.cat([it.streams for it in items])
        logits, x = f.run_mtp(meta, streams)
        return logits, x[torch.tensor(rows, device=x.device)]
