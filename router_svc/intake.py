"""Bounded work before validation: what a Generate request may cost the router before it is
known to be valid.

1. Prompt bytes. A text prompt is measured in UTF-8 bytes before it is tokenized. The sound
   direction of "bytes vs tokens" is `tokens >= bytes / max_token_bytes`: with a byte-level BPE
   and nothing that deletes text on the way (no normalizer, no pre-tokenizer that drops
   characters, no added token that strips whitespace), every prompt byte ends up inside exactly
   one token, and no token covers more than `max_token_bytes` bytes (the longest vocabulary
   entry). A prompt of more than `max_model_len * max_token_bytes` bytes therefore has more than
   `max_model_len` tokens and is refused outright; validation would refuse it anyway, so this
   byte cap never rejects a prompt that could be served. Special tokens the tokenizer adds only
   add tokens. When the tokenizer can delete text the bound would be unsound, so it is off
   (`max_token_bytes == 0`) and only gRPC's message limit and the bounded pool apply.
2. Tokenizing. Prompts up to `INLINE_PROMPT_CHARS` are tokenized on the event loop (well under
   a millisecond); longer ones in `TokenizerPool`: `max_threads` threads, at most `max_waiting`
   more prompts queued, and beyond that RESOURCE_EXHAUSTED with a retry hint.
3. Sampling the engine cannot sample. See `normalize_sampling`.

Used by the servicer on the event loop (the pool's threads run only the tokenizer).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tokenizers import Tokenizer

from dsv4.errors import InvalidRequest, ResourceExhausted
from dsv4.types import GenerateRequest

T = TypeVar("T")
INLINE_PROMPT_CHARS = 2048  # at most 8 KiB: tokenized on the event loop
MAX_UTF8_BYTES_PER_CHAR = 4
# Below this temperature softmax(logits / T) is one-hot to within fp32 for any logit gap above
# ~1e-3 (vLLM's _SAMPLING_EPS), and smaller values overflow or underflow on the way: greedy.
MIN_SAMPLING_TEMPERATURE = 1e-5

# Pre-tokenizers that split text without dropping any of it (Split and Punctuation unless their
# behaviour is "removed"); anything else (Whitespace, Metaspace, ...) voids the byte bound.
_SPLITTERS = {"Split", "Punctuation"}
_KEEPERS = {"ByteLevel", "Digits"}


def _keeps_every_byte(pre: Any) -> bool:
    if not isinstance(pre, dict):
        return False
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_every_byte(p) for p in pre.get("pretokenizers", ()))
    if kind in _SPLITTERS:
        return str(pre.get("behavior", "")).lower() != "removed"
    return kind in _KEEPERS


def max_token_bytes(tokenizer: Tokenizer) -> int:
    """The most prompt bytes one token can cover, or 0 when no such bound holds (the tokenizer
    may delete text). Reads tokenizer.json once; byte-level BPE vocabulary entries spell one
    character per byte, added tokens are matched on their UTF-8 content."""
    spec = json.loads(tokenizer.to_str())
    normalizer = spec.get("normalizer")
    pre = spec.get("pre_tokenizer")
    model = spec.get("model") or {}
    added = spec.get("added_tokens") or []
    is_byte_level = "ByteLevel" in json.dumps(pre)
    if (
        (normalizer is not None and normalizer != {"type": "Sequence", "normalizers": []})
        or not (is_byte_level and _keeps_every_byte(pre))
        or model.get("type") != "BPE"
        or any(a.get("lstrip") or a.get("rstrip") for a in added)
    ):
        return 0
    lengths = [len(token) for token in model.get("vocab", {})]
    lengths += [len(str(a.get("content", "")).encode()) for a in added]
    return max(lengths, default=0)


def check_prompt_bytes(prompt: str, max_model_len: int, max_token_bytes: int) -> None:
    """Raise InvalidRequest when the prompt has more than `max_model_len * max_token_bytes`
    UTF-8 bytes (the module docstring says why that many bytes cannot fit); no-op without a
    sound bound. Costs one UTF-8 encode at most (the message limit bounds the prompt)."""
    limit = max_model_len * max_token_bytes
    if not limit or len(prompt) * MAX_UTF8_BYTES_PER_CHAR <= limit:
        return
    num_bytes = len(prompt.encode())
    if num_bytes > limit:
        raise InvalidRequest(
            f"prompt text has {num_bytes} bytes and a token covers at most {max_token_bytes}, "
            f"so it has more than max_model_len = {max_model_len} tokens: shorten the prompt"
        )


class TokenizerPool:
    """Tokenizes long prompts in `max_threads` threads; owned by the RouterServer (`close()`)."""

    def __init__(
        self,
        encode: Callable[[str, bool], Sequence[int]],
        max_threads: int = 2,
        max_waiting: int = 8,
    ) -> None:
        self._encode = encode
        self._executor = ThreadPoolExecutor(max_threads, thread_name_prefix="router-tokenize")
        self.max_admitted = max_threads + max_waiting
        self.num_admitted = 0

    async def encode(self, text: str, add_special_tokens: bool = True) -> Sequence[int]:
        return await self.run(lambda: self._encode(text, add_special_tokens),
                              "or send prompt_token_ids")  # fmt: skip

    async def run(self, work: Callable[[], T], fix: str = "") -> T:
        """`work` (tokenizer calls that release the GIL: /tokenize and /detokenize's long
        texts too) on the pool's threads, within the same bound as `encode`; `fix`: what
        else a refused caller can do."""
        if self.num_admitted >= self.max_admitted:
            raise ResourceExhausted(
                f"the router is tokenizing {self.num_admitted} long texts already: retry "
                f"later{', ' + fix if fix else ''}",
                retry_after_s=1.0,
            )
        self.num_admitted += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, work)
        finally:
            self.num_admitted -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def normalize_sampling(request: GenerateRequest, vocab_size: int) -> GenerateRequest:
    """Sampling values that pass validation (which refuses those fp32 cannot evaluate at all)
    but can only ever pick the most likely token become the greedy decoding they denote:
    - top_p < 1 / vocab_size: the most likely token alone has probability >= 1 / vocab_size,
      so the nucleus is exactly that token: greedy (ties aside), exactly;
    - 0 < temperature < MIN_SAMPLING_TEMPERATURE: the limit T -> 0 is greedy."""
    s = request.sampling
    is_degenerate = s.temperature > 0 and (
        s.temperature < MIN_SAMPLING_TEMPERATURE or s.top_p < 1.0 / vocab_size
    )
    if not is_degenerate:
        return request
    greedy = dataclasses.replace(s, temperature=0.0, top_p=1.0, top_k=0)
    return dataclasses.replace(request, sampling=greedy)
