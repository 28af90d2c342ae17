"""Synthetic workloads: the request type every part of loadgen shares, plus random and
shared-prefix generators. File-backed workloads (ShareGPT, Mooncake trace) live in
`loadgen.datasets`.

Token ids are "vocabulary-safe": drawn from [FIRST_SAFE_TOKEN_ID, vocab_size), which skips the
BOS (0) and EOS (1) ids of DeepSeek tokenizers so a random prompt never ends a sequence early.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FIRST_SAFE_TOKEN_ID = 2
DEFAULT_VOCAB_SIZE = 129280


@dataclass(frozen=True)
class LoadRequest:
    """One request to send. Exactly one of `prompt_token_ids` and `prompt_text` is set.

    `input_len` is the prompt length in tokens when known exactly (token-id prompts), else an
    estimate; the server's `usage.prompt_tokens` wins in the metrics when it reports one.
    `arrival_offset_s` is set only by timed workloads (trace replay).
    """

    request_id: str
    input_len: int
    output_len: int
    prompt_token_ids: tuple[int, ...] | None = None
    prompt_text: str | None = None
    arrival_offset_s: float | None = None

    def __post_init__(self) -> None:
        if (self.prompt_token_ids is None) == (self.prompt_text is None):
            raise ValueError("LoadRequest needs exactly one of prompt_token_ids, prompt_text")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")


@dataclass(frozen=True)
class LengthRange:
    """Lengths drawn uniformly from [mean*(1-ratio), mean*(1+ratio)], at least 1 (vLLM's
    `--random-range-ratio`)."""

    mean: int
    range_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.mean < 1:
            raise ValueError(f"length must be >= 1, got {self.mean}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range ratio must be in [0, 1), got {self.range_ratio}")

    @property
    def low(self) -> int:
        return max(1, int(self.mean * (1.0 - self.range_ratio)))

    @property
    def high(self) -> int:
        return max(self.low, int(self.mean * (1.0 + self.range_ratio)))

    def sample(self, rng: np.random.Generator, num: int) -> list[int]:
        """Draw `num` lengths, inclusive of both ends."""
        return [int(x) for x in rng.integers(self.low, self.high + 1, size=num)]


def random_token_ids(rng: np.random.Generator, num: int, vocab_size: int) -> tuple[int, ...]:
    """`num` ids uniform in [FIRST_SAFE_TOKEN_ID, vocab_size)."""
    if vocab_size <= FIRST_SAFE_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {FIRST_SAFE_TOKEN_ID}, got {vocab_size}")
    return tuple(int(x) for x in rng.integers(FIRST_SAFE_TOKEN_ID, vocab_size, size=num))


def random_requests(
    num_prompts: int,
    input_len: LengthRange,
    output_len: LengthRange,
    vocab_size: int,
    seed: int,
    id_prefix: str = "req",
) -> list[LoadRequest]:
    """Independent random prompts with lengths drawn from the two ranges."""
    rng = np.random.default_rng(seed)
    in_lens = input_len.sample(rng, num_prompts)
    out_lens = output_len.sample(rng, num_prompts)
    return [
        LoadRequest(
            request_id=f"{id_prefix}-{i}",
            input_len=n_in,
            output_len=n_out,
            prompt_token_ids=random_token_ids(rng, n_in, vocab_size),
        )
        for i, (n_in, n_out) in enumerate(zip(in_lens, out_lens))
    ]


def shared_prefix_requests(
    num_prompts: int,
    prefix_len: int,
    num_groups: int,
    suffix_len: LengthRange,
    output_len: LengthRange,
    vocab_size: int,
    seed: int,
    id_prefix: str = "req",
) -> list[LoadRequest]:
    """Prompts in `num_groups` groups; every prompt of a group starts with the same
    `prefix_len` tokens (a system prompt) followed by its own random suffix. Groups are
    interleaved in a seeded random order so prefix-aware routing has work to do."""
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    rng = np.random.default_rng(seed)
    prefixes = [random_token_ids(rng, prefix_len, vocab_size) for _ in range(num_groups)]
    groups = rng.permutation(np.arange(num_prompts) % num_groups)
    suffix_lens = suffix_len.sample(rng, num_prompts)
    out_lens = output_len.sample(rng, num_prompts)
    out: list[LoadRequest] = []
    for i in range(num_prompts):
        ids = prefixes[int(groups[i])] + random_token_ids(rng, suffix_lens[i], vocab_size)
        out.append(
            LoadRequest(
                request_id=f"{id_prefix}-{i}",
                input_len=len(ids),
                output_len=out_lens[i],
                prompt_token_ids=ids,
            )
        )
    return out
