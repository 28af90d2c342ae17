"""The prompt logprobs a step's prefill chunks asked for (`SamplingParams.prompt_logprobs`).

A chunk's row at position p predicts the prompt token at p + 1 (the chunk's
`ScheduledRequest.prompt_logprob_targets`, so the last row of a chunk predicts the next
chunk's first token and no position is missed or doubled across chunks). The forward has
every row's final streams anyway; for the chunks that asked, the model's head (hc_head ->
final norm -> lm head: `Head`) runs over those rows, and the log_softmax of the raw logits
gives each target's logprob, its rank and the N most likely tokens, as generation logprobs do
(vLLM's default `raw_logprobs`). A step where no chunk asked builds none of this
(`StepPromptLogprobs.of` is None): other requests cost nothing more.

Rows go through the head HEAD_ROWS at a time, so a long chunk never holds its whole [T, V]
fp32 logits: DeepSeek-V4's [512, 129280] fp32 logits are 265 MB, their log_softmax as much
again. Each slice leaves only its packed results ([rows, 2 + 2 N] fp64) on the device; the
step's chunks reach the host in one copy (`fetch`, after the sampler's).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsv4.scheduler.batch import ScheduledBatch, ScheduledRequest
from dsv4.types import TokenLogprobs

HEAD_ROWS = 512  # rows per head slice: [512, V] fp32 logits, 265 MB at V = 129280

# final streams [R, M, D] -> raw logits [R, V] fp32 (the forward's own head ops)
Head = Callable[[torch.Tensor], torch.Tensor]


class StepPromptLogprobs:
    """One step's prompt logprobs, from `of` to `fetch` (engine thread)."""

    def __init__(self, head: Head) -> None:
        self._head = head
        self._packed: list[torch.Tensor] = []  # per chunk [R * (2 + 2 N)] fp64, on the device
        self._chunks: list[tuple[str, int, int]] = []  # (request id, R rows, N top)

    @classmethod
    def of(cls, batch: ScheduledBatch, head: Head) -> StepPromptLogprobs | None:
        """None when no chunk of the step asked: the step costs nothing more."""
        return cls(head) if any(r.prompt_logprob_targets for r in batch.requests) else None

    def add(self, request: ScheduledRequest, streams: torch.Tensor) -> None:
        """`streams` [S, M, D]: the chunk's final streams, row i at position start + i (S at
        least its targets); computes its targets' logprobs on the streams' device."""
        targets = request.prompt_logprob_targets
        if not targets:
            return
        assert request.sampling_params is not None  # targets exist only when it asked
        asked = n = int(request.sampling_params.prompt_logprobs or 0)
        ids = torch.tensor(targets, dtype=torch.long).to(streams.device)  # [R]
        parts, num_rows = [], len(targets)
        for lo in range(0, num_rows, HEAD_ROWS):
            rows = streams[lo : min(lo + HEAD_ROWS, num_rows)].contiguous()  # [r, M, D]
            logprobs = torch.log_softmax(self._head(rows).float(), dim=-1)  # [r, V] fp32
            n = min(asked, logprobs.shape[-1])
            own = logprobs.gather(1, ids[lo : lo + HEAD_ROWS].unsqueeze(1))  # [r, 1]
            rank = (logprobs >= own).sum(dim=-1, keepdim=True)  # [r, 1]: vLLM counts ties in
            values, top = logprobs.topk(n, dim=-1)  # [r, N] each, best first
            parts.append(torch.cat([own.double(), rank.double(), top.double(),
                                    values.double()], dim=1))  # [r, 2 + 2 N]  # fmt: skip
        self._packed.append(torch.cat(parts).flatten())
        self._chunks.append((request.request_id, num_rows, n))

    def fetch(self) -> dict[str, tuple[TokenLogprobs, ...]]:
        """Request id -> its chunk's entries, one per target in order: one copy of
        [sum R (2 + 2 N)] fp64 (exact for token ids, ranks and fp32 values)."""
        host = torch.cat(self._packed).tolist() if self._packed else []
        out, at = {}, 0
        for request_id, num_rows, n in self._chunks:
            width, entries = 2 + 2 * n, []
            for row in range(at, at + num_rows * width, width):
                own, rank = host[row], int(host[row + 1])
                ids, values = host[row + 2 : row + 2 + n], host[row + 2 + n : row + width]
                entries.append(TokenLogprobs(own, tuple(zip(map(int, ids), values)), rank))
            out[request_id] = tuple(entries)
            at += num_rows * width
        return out
