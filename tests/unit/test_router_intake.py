"""router_svc.intake: the prompt byte cap is sound (never refuses a prompt that fits), is off for
tokenizers that can delete text, the tokenizer pool is bounded and leaves the event loop
running, and sampling values no sampler can evaluate become the greedy decoding they denote."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers

from dsv4.errors import InvalidRequest, ResourceExhausted
from dsv4.text.tokenizer import build_tokenizer
from dsv4.types import GenerateRequest, SamplingParams
from router_svc.intake import (
    TokenizerPool,
    check_prompt_bytes,
    max_token_bytes,
    normalize_sampling,
)
from router_svc.text_model import text_model

TINY = text_model(build_tokenizer(1024), source="tiny")
PIECES = st.sampled_from(["<bos>", "<eos>", "    ", "\n\n", "é", "€", "😀", "the ", "x" * 40])


def test_tiny_tokenizer_has_a_bound_and_encode_matches_the_codec() -> None:
    assert TINY.max_token_bytes == max(len(t) for t in TINY.tokenizer.get_vocab()) > 1
    text = "The quick brown fox <bos> jumps 😀 éé"
    assert TINY.encode(text) == TINY.codec.encode(text)


@settings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(st.lists(st.text(max_size=30) | PIECES, max_size=20).map("".join))
def test_no_token_covers_more_bytes_than_the_bound(text: str) -> None:
    """The soundness the cap rests on: bytes <= max_token_bytes * tokens, for any text."""
    num_tokens = len(TINY.encode(text))
    assert len(text.encode()) <= TINY.max_token_bytes * num_tokens
    check_prompt_bytes(text, max(1, num_tokens), TINY.max_token_bytes)  # fits: never refused


def test_a_deepseek_shaped_tokenizer_keeps_the_bound() -> None:
    """DeepSeek's tokenizer.json: an empty normalizer Sequence, isolating Splits and Digits,
    then ByteLevel: nothing is deleted, so the bound holds."""
    tokenizer = build_tokenizer(300)
    tokenizer.normalizer = normalizers.Sequence([])
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), "isolated"),
        pre_tokenizers.Digits(individual_digits=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    model = text_model(tokenizer)
    text = "Explicit 12345 is better than implicit 😀 <bos>  \n\n" * 20
    assert model.max_token_bytes > 1
    assert len(text.encode()) <= model.max_token_bytes * len(model.encode(text))


def test_tokenizers_that_can_delete_text_have_no_bound() -> None:
    lower = build_tokenizer(300)
    lower.normalizer = normalizers.Lowercase()
    split = build_tokenizer(300)
    split.pre_tokenizer = pre_tokenizers.Whitespace()  # drops the spaces
    stripping = build_tokenizer(300)
    stripping.add_special_tokens([AddedToken("<sep>", rstrip=True)])
    assert [max_token_bytes(t) for t in (lower, split, stripping)] == [0, 0, 0]
    check_prompt_bytes("x" * 100_000, 10, 0)  # no bound: nothing refused here


def test_byte_cap_is_exact_and_counts_utf8_bytes() -> None:
    check_prompt_bytes("a" * 60, 4, 15)
    with pytest.raises(InvalidRequest, match="61 bytes"):
        check_prompt_bytes("a" * 61, 4, 15)
    with pytest.raises(InvalidRequest, match=r"64 bytes.*max_model_len = 4"):
        check_prompt_bytes("😀" * 16, 4, 15)  # 16 characters, 64 bytes
    started = time.monotonic()
    with pytest.raises(InvalidRequest):
        check_prompt_bytes("a" * 16_000_000, 4096, 15)
    assert time.monotonic() - started < 0.5


def test_pool_refuses_beyond_its_bound_and_leaves_the_loop_running() -> None:
    async def body() -> None:
        pool = TokenizerPool(TINY.encode, max_threads=1, max_waiting=1)
        text = "Readability counts. Errors should never pass silently. " * 8000
        gaps: list[float] = []

        async def tick() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.005)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        ticker = asyncio.create_task(tick())
        try:
            started = time.monotonic()
            first, second = pool.encode(text), pool.encode(text)
            jobs = [asyncio.ensure_future(first), asyncio.ensure_future(second)]
            await asyncio.sleep(0)
            with pytest.raises(ResourceExhausted, match="retry"):
                await pool.encode("one too many")
            results = await asyncio.gather(*jobs)
            elapsed_s = time.monotonic() - started
        finally:
            ticker.cancel()
            pool.close()
        assert results[0] == results[1] == TINY.codec.encode(text)
        assert pool.num_admitted == 0
        assert max(gaps) < max(0.25 * elapsed_s, 0.05), (max(gaps), elapsed_s)

    asyncio.run(asyncio.wait_for(body(), 30))


def _request(**sampling: float) -> GenerateRequest:
    return GenerateRequest("r", (5, 9, 200), SamplingParams(max_new_tokens=4, **sampling))


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1.0, "top_p": 1e-300},  # rounds to 0 in fp32: every token filtered
        {"temperature": 1.0, "top_p": 1e-45, "top_k": 1},
        {"temperature": 1e-30},  # logits / T overflow
        {"temperature": 5e-324, "top_p": 0.5},
    ],
)
def test_degenerate_sampling_becomes_greedy(sampling: dict[str, float]) -> None:
    normalized = normalize_sampling(_request(**sampling), vocab_size=1024).sampling
    assert (normalized.temperature, normalized.top_p, normalized.top_k) == (0.0, 1.0, 0)
    assert normalized.max_new_tokens == 4


@pytest.mark.parametrize(
    "sampling",
    [{}, {"temperature": 0.7, "top_p": 0.9, "top_k": 40}, {"temperature": 1e-5, "top_p": 0.001}],
)
def test_samplable_values_are_left_alone(sampling: dict[str, float]) -> None:
    request = _request(**sampling)
    assert normalize_sampling(request, vocab_size=1024) is request
