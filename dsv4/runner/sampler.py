"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeds.

Every request samples from its own `torch.Generator` when it carries a seed, so its output
does not depend on which other requests share the batch. Temperature 0 is greedy (argmax, ties
to the lowest id). On GPU, FlashInfer's sampling kernels can replace the torch path; this file
is the reference both must agree with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingSpec:
    """What the sampler needs of one request's sampling parameters."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0


def filtered_probs(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """[V] logits -> [V] fp32 probabilities after temperature, top-k and top-p."""
    scaled = logits.float() / max(spec.temperature, 1e-6)
    vocab = scaled.shape[-1]
    if 0 < spec.top_k < vocab:
        kth = torch.topk(scaled, spec.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if spec.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        drop_sorted = (cumulative - sorted_probs) >= spec.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum()
    return probs


class Sampler:
    """Samples one token per row of a logits batch; owns the per-request generators."""

    def __init__(self, default_seed: int = 0) -> None:
        self._default = torch.Generator().manual_seed(default_seed)
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, request_id: str, spec: SamplingSpec) -> torch.Generator:
        if spec.seed is None:
            return self._default
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator().manual_seed(spec.seed)
            self._generators[request_id] = gen
        return gen

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], specs: list[SamplingSpec]
    ) -> list[int]:
        """logits [B, V] (any device) -> B token ids. Greedy rows never touch a generator."""
        if logits.shape[0] != len(specs) or len(specs) != len(request_ids):
            raise ValueError("one request id and one SamplingSpec per logits row")
        out: list[int] = []
        greedy = logits.argmax(dim=-1).tolist() if logits.shape[0] else []
        for row, (rid, spec) in enumerate(zip(request_ids, specs)):
            if spec.is_greedy:
                out.append(int(greedy[row]))
                continue
            probs = filtered_probs(logits[row], spec).cpu()
            out.append(int(torch.multinomial(probs, 1, generator=self._generator(rid, spec))))
        return out

    def probs(self, logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
        """[B, V] filtered probabilities (used by speculative rejection sampling)."""
        if not specs:
            return logits.float()
        return torch.stack([filtered_probs(logits[i], s) for i, s in enumerate(specs)])

    def uniform(self, request_id: str, spec: SamplingSpec) -> float:
        """One U(0,1) draw from the request's generator (speculative acceptance tests)."""
        return float(torch.rand((), generator=self._generator(request_id, spec)))

    def categorical(self, probs: torch.Tensor, request_id: str, spec: SamplingSpec) -> int:
        """One draw from a [V] distribution with the request's generator."""
        return int(
            torch.multinomial(probs.float().cpu(), 1, generator=self._generator(request_id, spec))
        )

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator."""
        self._generators.pop(request_id, None)

    @property
    def num_live_generators(self) -> int:
        return len(self._generators)
