"""Acceptance counters per draft position (vLLM's `num_accepted_tokens_per_pos`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    """Counts over verify steps that carried at least one draft.

    `num_drafted[i]`: drafts proposed at position i (0-based: d_{i+1});
    `num_accepted[i]`: of those, how many were accepted (so were all drafts before them).
    """

    num_speculative_tokens: int
    num_verify_steps: int = 0
    num_drafted: list[int] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        self.num_drafted = self.num_drafted or [0] * k
        self.num_accepted = self.num_accepted or [0] * k

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verify step: `num_drafts` proposed, the first `num_accepted` kept."""
        if not num_drafts:
            return
        assert 0 <= num_accepted <= num_drafts <= self.num_speculative_tokens
        self.num_verify_steps += 1
        for i in range(num_drafts):
            self.num_drafted[i] += 1
            self.num_accepted[i] += i < num_accepted

    def acceptance_rate(self, position: int) -> float:
        """P(draft at `position` accepted) over the steps that proposed it (0.0 if none)."""
        drafted = self.num_drafted[position]
        return self.num_accepted[position] / drafted if drafted else 0.0

    @property
    def acceptance_rates(self) -> list[float]:
        return [self.acceptance_rate(i) for i in range(self.num_speculative_tokens)]

    @property
    def mean_tokens_per_step(self) -> float:
        """Tokens emitted per verify step: 1 + accepted drafts (1.0 if none yet)."""
        if not self.num_verify_steps:
            return 1.0
        return 1.0 + sum(self.num_accepted) / self.num_verify_steps

    def as_dict(self) -> dict[str, object]:
        return {
            "num_verify_steps": self.num_verify_steps,
            "num_drafted": list(self.num_drafted),
            "num_accepted": list(self.num_accepted),
            "acceptance_rate": [round(r, 4) for r in self.acceptance_rates],
            "mean_tokens_per_step": round(self.mean_tokens_per_step, 4),
        }
