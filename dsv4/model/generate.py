"""Cached decode loop of the reference model (for `dsv4 generate`).

Prefill the prompt once into a `SequenceState`, then feed one token per step. Greedy when
temperature == 0; otherwise temperature -> top-k -> top-p (nucleus) sampling from a seeded
generator, so a given seed reproduces the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dsv4.errors import InvalidRequest
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.ops.sampling import SamplingSpec, filtered_probs


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    top_k: int,
    generator: torch.Generator | None,
) -> int:
    """logits [V] fp32 -> one token id (the engine sampler's filters, one generator)."""
    spec = SamplingSpec(temperature=temperature, top_p=top_p, top_k=top_k)
    if spec.is_greedy:
        return int(logits.argmax())
    return int(torch.multinomial(filtered_probs(logits, spec).cpu(), 1, generator=generator))


@torch.no_grad()
def generate(
    model: DeepseekV4,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0,
    top_p: float = 1,
    top_k: int = 0,
    seed: int | None = None,
    stop_token_ids: Iterable[int] = (),
) -> list[int]:
    """New token ids after `prompt_ids` (a stop token, if hit, is included and ends it)."""
    if not prompt_ids:
        raise InvalidRequest("prompt_ids is empty")
    if not 0 < top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}")
    stops = set(stop_token_ids)
    generator = None
    if temperature > 0:
        generator = torch.Generator()
        generator.manual_seed(seed if seed is not None else torch.seed())
    device = model.embed.weight.device
    state = model.new_state()
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    out: list[int] = []
    while len(out) < max_new_tokens:
        logits = model(ids, states=[state], last_only=True).logits[-1]  # [V]
        token = sample_next(logits, temperature, top_p, top_k, generator)
        out.append(token)
        if token in stops:
            break
        ids = torch.tensor([token], dtype=torch.long, device=device)
    return out
