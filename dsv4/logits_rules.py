"""When a request's sampling needs its logits row, for the request's parameters
(`dsv4.types.SamplingParams`, torch-free: the router reads them) and the sampler's spec
(`dsv4.ops.sampling.SamplingSpec`) alike: one rule, in a module both may import (dsv4.ops may
not import dsv4.types, and dsv4.types must stay free of torch).
"""

from __future__ import annotations


class LogitsRules:
    """Mixin of a frozen dataclass with fields presence_penalty, frequency_penalty,
    repetition_penalty, logit_bias and logprobs (no state of its own: `__slots__ = ()`, so a
    slotted dataclass stays slotted)."""

    __slots__ = ()
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: tuple[tuple[int, float], ...]
    logprobs: int | None

    @property
    def has_penalties(self) -> bool:
        """Any of the three penalties on: the logits depend on the tokens so far."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)  # fmt: skip

    @property
    def shifts_logits(self) -> bool:
        """The logits are shifted (penalties, a logit bias) before a token is picked, so the
        raw logits' argmax is not the greedy token."""
        return self.has_penalties or bool(self.logit_bias)

    @property
    def needs_logits_processing(self) -> bool:
        """The sampler needs the row's logits: they are shifted, or its logprobs are read from
        them (either keeps the row off the in-graph argmax)."""
        return self.shifts_logits or self.logprobs is not None
