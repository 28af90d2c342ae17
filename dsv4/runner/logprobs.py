"""The logprobs a step's rows asked for (`SamplingSpec.logprobs`: OpenAI's `logprobs`).

As vLLM's default (`raw_logprobs`): log_softmax of the model's raw logits, before temperature,
penalties, logit_bias, top-k and top-p, for the sampled token and the N most likely ones. Only
the rows that asked are computed, on the logits' device ([R, V] log_softmax, its top-N, each
row's token's entry), and they reach the host in the copy that brings the step's tokens
(`fetch`). A row whose token is drawn on the host after that copy (seeded or row-by-row
sampling) reads its token's entry with one more small copy (`finish`), in such steps only. A
step where no row asked builds none of this (`StepLogprobs.of` is None).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from dsv4.ops.sampling import SamplingSpec
from dsv4.types import TokenLogprobs


class StepLogprobs:
    """One step's logprobs, from `of` to `finish` (engine thread)."""

    def __init__(self, logits: torch.Tensor, specs: Sequence[SamplingSpec]) -> None:
        """`logits` [B, V]: the step's raw logits (any dtype and device)."""
        self.rows = [i for i, s in enumerate(specs) if s.logprobs is not None]
        vocab = logits.shape[-1]
        self._counts = [min(int(specs[i].logprobs or 0), vocab) for i in self.rows]  # N per row
        self._index = torch.tensor(self.rows, dtype=torch.long).to(logits.device)  # [R]
        # [R, V] fp32: log_softmax of the rows that asked
        self._logprobs = torch.log_softmax(logits.index_select(0, self._index).float(), dim=-1)
        self._own: list[float] = []  # [R] each row's token's logprob, once fetched
        self._top: list[tuple[tuple[int, float], ...]] = []  # [R] its N best (id, logprob)

    @classmethod
    def of(cls, logits: torch.Tensor, specs: Sequence[SamplingSpec]) -> StepLogprobs | None:
        """None when no row asked: the step costs nothing more."""
        return cls(logits, specs) if any(s.logprobs is not None for s in specs) else None

    def fetch(self, picked: torch.Tensor) -> list[int]:
        """`picked` [B] int64 on the logits' device (the tokens the device chose) -> them on
        the host, the asked rows' logprobs beside them: one copy of [B + R + 2 R K] fp64 (exact
        for token ids and fp32 values)."""
        b, r, k = picked.shape[0], len(self.rows), max(self._counts)
        own = self._logprobs.gather(1, picked.index_select(0, self._index).unsqueeze(1))  # [R, 1]
        top_values, top_ids = self._logprobs.topk(k, dim=-1)  # [R, K] each, best first
        packed = torch.cat([picked.double(), own.double().flatten(),
                            top_ids.double().flatten(), top_values.double().flatten()])  # fmt: skip
        host = packed.tolist()  # the step's one device -> host copy
        tokens, self._own = [int(t) for t in host[:b]], host[b : b + r]
        ids, values = host[b + r : b + r + r * k], host[b + r + r * k :]
        self._top = [tuple((int(ids[j * k + c]), values[j * k + c]) for c in range(n))
                     for j, n in enumerate(self._counts)]  # fmt: skip
        return tokens

    def finish(
        self, tokens: Sequence[int], drawn_on_host: Collection[int]
    ) -> list[TokenLogprobs | None]:
        """One entry per row of the step (None: it did not ask), once `tokens` are final;
        `drawn_on_host`: the rows whose token was drawn after `fetch` (their own logprob is
        read now, in one copy)."""
        late = [j for j, row in enumerate(self.rows) if row in drawn_on_host]
        if late:
            device = self._logprobs.device
            rows = torch.tensor(late, dtype=torch.long).to(device)
            ids = torch.tensor([tokens[self.rows[j]] for j in late], dtype=torch.long).to(device)
            for j, value in zip(late, self._logprobs[rows, ids].tolist()):
                self._own[j] = value
        out: list[TokenLogprobs | None] = [None] * len(tokens)
        for j, row in enumerate(self.rows):
            out[row] = TokenLogprobs(self._own[j], self._top[j])
        return out
