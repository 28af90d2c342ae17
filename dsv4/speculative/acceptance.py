"""Which draft tokens a verify step keeps (greedy and rejection sampling).

Notation for one request verified at positions P..P+k: drafts d_1..d_k (d_i proposed for
position P+i), draft distributions q_i, target distributions p_0..p_k (p_i from the target's
logits at position P+i, i.e. for the token at P+i+1).

- Greedy: accept d_i while d_i == argmax p_{i-1}; then emit argmax p_a (the correction, or the
  bonus when all k were accepted). The output equals non-speculative greedy decoding exactly.
- Sampled (Leviathan et al. 2023, Chen et al. 2023): accept d_i with probability
  min(1, p_{i-1}(d_i) / q_i(d_i)); on the first rejection emit a sample of
  norm(max(0, p_{i-1} - q_i)) and stop; when all are accepted emit a sample of p_k. Every
  emitted token is then distributed exactly as under p, whatever q is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class RandomSource(Protocol):
    """The request's own random stream (`dsv4.runner.sampler.RequestRandom`)."""

    def uniform(self) -> float: ...

    def categorical(self, probs: torch.Tensor) -> int: ...


@dataclass(frozen=True)
class Draft:
    """What a drafter proposes for one request (both forwards' MTP halves draft these)."""

    token_ids: tuple[int, ...]  # d_1..d_k
    probs: torch.Tensor | None  # [k, V] fp32 q_1..q_k (sampled requests); None when greedy


def accept_greedy(draft_ids: Sequence[int], target_ids: Sequence[int]) -> tuple[int, ...]:
    """drafts d_1..d_k, target argmax ids g_0..g_k -> the emitted tokens g_0..g_a, where a
    is the number of leading drafts with d_i == g_{i-1} (a accepted drafts + 1 target token)."""
    if len(target_ids) != len(draft_ids) + 1:
        raise ValueError("need one target id per draft plus one")
    num_accepted = 0
    while num_accepted < len(draft_ids) and draft_ids[num_accepted] == target_ids[num_accepted]:
        num_accepted += 1
    return tuple(int(t) for t in target_ids[: num_accepted + 1])


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) [V]: what to sample after rejecting a draft from q. If p <= q
    everywhere (p == q up to rounding; rejection then has probability ~0) it is p."""
    residual = (p - q).clamp(min=0)
    total = residual.sum()
    return residual / total if total > 0 else p


def accept_sampled(
    draft_ids: Sequence[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    rng: RandomSource,
) -> tuple[int, ...]:
    """draft_probs [k, V] (q_1..q_k), target_probs [k + 1, V] (p_0..p_k) -> emitted tokens:
    the accepted drafts, then one token from the residual (rejection) or from p_k (bonus).
    Draws: one uniform per examined draft, one categorical at the end."""
    k = len(draft_ids)
    if draft_probs.shape[0] != k or target_probs.shape[0] != k + 1:
        raise ValueError("need k draft distributions and k + 1 target distributions")
    out: list[int] = []
    for i, token in enumerate(draft_ids):
        p, q = target_probs[i], draft_probs[i]
        # u < p/q  <=>  u * q < p   (q(d) > 0: d was drawn from q)
        if rng.uniform() * float(q[token]) < float(p[token]):
            out.append(int(token))
            continue
        out.append(rng.categorical(residual_probs(p, q)))
        return tuple(out)
    out.append(rng.categorical(target_probs[k]))
    return tuple(out)
