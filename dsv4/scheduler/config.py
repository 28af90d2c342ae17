"""Scheduler knobs (one frozen sub-config of the serve config; validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass

from dsv4.errors import ConfigError
from dsv4.scheduler import policy


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 16384  # tokens per step, draft positions included
    max_num_seqs: int = 256
    max_model_len: int = 65536
    num_speculative_tokens: int = 0  # MTP draft tokens per decode (k)
    spec_budget: str = "adaptive"  # "adaptive" | "static" (baseline, #51725)
    prefill_chunk_plan: str = "area"  # "area" | "fixed" (baseline, #45061)
    prefill_chunk_group_size: int = 4  # fixed planner's requests per chunk; sets area budget
    chunk_area_budget: int = 0  # workspace rows per prefill chunk; 0: derived as above

    def __post_init__(self) -> None:
        positive = ("max_num_batched_tokens", "max_num_seqs", "max_model_len")
        for name in (*positive, "prefill_chunk_group_size"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be >= 1")
        if self.chunk_area_budget < 0:
            raise ConfigError("chunk_area_budget", self.chunk_area_budget, "use >= 0 (0: derived)")
        if self.num_speculative_tokens < 0:
            raise ConfigError("num_speculative_tokens", self.num_speculative_tokens, "use >= 0")
        per_step = self.max_num_seqs * (1 + self.num_speculative_tokens)
        if self.max_num_batched_tokens < per_step:
            raise ConfigError(
                "max_num_batched_tokens",
                self.max_num_batched_tokens,
                f"must cover one decode step of every sequence: >= max_num_seqs * (1 + "
                f"num_speculative_tokens) = {per_step}; raise it or lower max_num_seqs",
            )
        if self.spec_budget not in policy.SPEC_BUDGET_MODES:
            raise ConfigError("spec_budget", self.spec_budget, "use adaptive or static")
        if self.prefill_chunk_plan not in policy.CHUNK_PLAN_MODES:
            raise ConfigError("prefill_chunk_plan", self.prefill_chunk_plan, "use area or fixed")
