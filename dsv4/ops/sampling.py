"""The sampling reference: one request's sampling parameters (`SamplingSpec`), the logit bias
(`biased_logits`) and the penalties that shift a logits row by the tokens so far
(`penalized_logits`), bias first as vLLM's sampler does, and the distribution they leave of it
(temperature, top-k, top-p). The row-by-row sampler (dsv4/runner/sampler.py)
samples from it and the batched kernels (kernels/sampling.py) must agree with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4.logits_rules import LogitsRules
from dsv4.ops.limits import MIN_TEMPERATURE


@dataclass(frozen=True)
class SamplingSpec(LogitsRules):
    """What the sampler needs of one request's sampling parameters."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    presence_penalty: float = 0.0  # off
    frequency_penalty: float = 0.0  # off
    repetition_penalty: float = 1.0  # off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs; () = off
    logprobs: int | None = None  # top logprobs besides the token's own; None = off

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0


def biased_logits(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """[V] logits -> [V] fp32 with OpenAI's `logit_bias` added to its tokens' logits. vLLM's
    sampler applies it before the penalties (its `LogitBiasLogitsProcessor` runs with the
    non-argmax-invariant processors, then `apply_penalties`; vllm/v1/sample/sampler.py): so
    does `Sampler`, so a repetition penalty scales a biased logit."""
    out = logits.float().clone()
    if spec.logit_bias:
        ids, biases = zip(*spec.logit_bias, strict=True)
        out[torch.tensor(ids, dtype=torch.long, device=out.device)] += torch.tensor(
            biases, dtype=torch.float32, device=out.device
        )
    return out


def penalized_logits(logits: torch.Tensor, spec: SamplingSpec, prompt_ids: Sequence[int],
                     output_ids: Sequence[int]) -> torch.Tensor:  # fmt: skip
    """[V] logits -> [V] fp32 with vLLM's (and OpenAI's) penalties: every token of the prompt
    and the output so far has a positive logit divided by `repetition_penalty` and a negative
    one multiplied by it; then each output token's logit loses `frequency_penalty` per
    occurrence and `presence_penalty` once."""
    out = logits.float().clone()
    if spec.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*prompt_ids, *output_ids}), dtype=torch.long,
                            device=out.device)  # fmt: skip
        values = out[seen]
        out[seen] = torch.where(values > 0, values / spec.repetition_penalty,
                                values * spec.repetition_penalty)  # fmt: skip
    if output_ids and (spec.frequency_penalty or spec.presence_penalty):
        ids = torch.tensor(list(output_ids), dtype=torch.long, device=out.device)
        counts = torch.bincount(ids, minlength=out.shape[-1]).float()
        out -= spec.frequency_penalty * counts + spec.presence_penalty * (counts > 0).float()
    return out


def filtered_probs(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """[V] logits -> [V] fp32 probabilities after temperature, top-k and top-p."""
    scaled = logits.float() / max(spec.temperature, MIN_TEMPERATURE)
    vocab = scaled.shape[-1]
    if 0 < spec.top_k < vocab:
        kth = torch.topk(scaled, spec.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if spec.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p; the first token always stays,
        # also when top_p rounds to 0 in fp32 (the comparison's dtype).
        drop_sorted = (cumulative - sorted_probs) >= spec.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum()
    return or_argmax(probs, logits)


def or_argmax(probs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """[..., V] probabilities, except that a row without finite positive mass (NaN or inf
    logits, everything filtered out) becomes one-hot on its logits' argmax: every row can
    be sampled, and `torch.multinomial` never sees NaN."""
    ok = torch.isfinite(probs).all(-1, keepdim=True) & (probs.sum(-1, keepdim=True) > 0)
    best = torch.nan_to_num(logits.float(), nan=float("-inf")).argmax(-1, keepdim=True)
    return torch.where(ok, probs, torch.zeros_like(probs).scatter(-1, best, 1.0))
