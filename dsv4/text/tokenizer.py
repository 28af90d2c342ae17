"""Tokenizer for tiny checkpoints, and the thin wrapper every service uses to (de)tokenize.

The tiny tokenizer is a byte-level BPE trained on a fixed text shipped here, so it is the same on
every machine and Python version. Ids 0 and 1 are BOS and EOS, as in DeepSeek-V4.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dsv4.errors import CheckpointError, ConfigError

_CORPUS = """\
Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex.
Complex is better than complicated. Flat is better than nested. Sparse is better than dense.
Readability counts. Special cases aren't special enough to break the rules.
Although practicality beats purity. Errors should never pass silently. Unless explicitly silenced.
In the face of ambiguity, refuse the temptation to guess.
There should be one-- and preferably only one --obvious way to do it.
Now is better than never. Although never is often better than *right* now.
If the implementation is hard to explain, it's a bad idea.
If the implementation is easy to explain, it may be a good idea.
Namespaces are one honking great idea -- let's do more of those!
The quick brown fox jumps over the lazy dog while the model serves tokens to every client.
A prefill worker computes the prompt once and hands the compressed key value cache to a decode
worker, which streams one token after another until the request is finished or cancelled.
def forward(self, hidden_states, positions): return self.norm(self.layers(hidden_states))
for index in range(0, 128): total = total + weights[index] * values[index]
import torch; import numpy as np; print("hello, world", 1234567890, 3.14159, [0, 1, 2])
The router chooses the least loaded prefill worker and the decode worker with the most free blocks.
Latency, throughput, goodput, time to first token and time per output token are measured here.
"""

BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"


def build_tokenizer(vocab_size: int, bos_id: int = 0, eos_id: int = 1) -> Tokenizer:
    """Train the deterministic byte-level BPE; specials take ids `bos_id` and `eos_id`."""
    if sorted((bos_id, eos_id)) != [0, 1]:
        raise ValueError("the tiny tokenizer puts BOS/EOS at ids 0 and 1")
    specials = [BOS_TOKEN, EOS_TOKEN] if bos_id == 0 else [EOS_TOKEN, BOS_TOKEN]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    return tok


def read_tokenizer(path: Path) -> Tokenizer:
    """A tokenizer.json, or a ConfigError naming the file (not a CheckpointError: a worker
    serves token ids without a tokenizer, not with a broken one)."""
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers package raises a bare Exception on a bad file
        reason = " ".join(str(exc).split())
        fix = "replace it with the model's own, or delete it to run token ids only"
        raise ConfigError(
            "model.tokenizer", str(path), f"not a tokenizer.json ({reason}): {fix}"
        ) from exc


class TextCodec:
    """Encode prompts and decode streamed token ids, incrementally (for stop strings)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TextCodec:
        path = Path(model_dir) / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"{path} is missing: the model directory has no tokenizer")
        return cls(read_tokenizer(path))

    @classmethod
    def from_dir_if_present(cls, model_dir: str | Path) -> TextCodec | None:
        """The checkpoint's tokenizer, or None for a token-ids-only checkpoint (no
        tokenizer.json: callers then take and return token ids, as vLLM's
        --skip-tokenizer-init does)."""
        path = Path(model_dir) / "tokenizer.json"
        return cls(read_tokenizer(path)) if path.exists() else None

    @property
    def tokenizer(self) -> Tokenizer:
        """The `tokenizers.Tokenizer` (for `tokenizers.decoders.DecodeStream`)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def token_text(self, token_id: int) -> str | None:
        """The token's own string (e.g. the BOS marker a chat template writes); None if unknown."""
        return self._tok.id_to_token(token_id)

    def token_string(self, token_id: int) -> str:
        """The token's text decoded alone, special tokens spelled out (OpenAI logprobs'
        `token`, as vLLM writes it); a piece of a multi-byte character reads U+FFFD."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def prompt_text(self, ids: list[int]) -> str:
        """Token ids' text with their special tokens spelled out (what OpenAI's `echo` answers
        for a token-id prompt, as vLLM decodes it)."""
        return self._tok.decode(ids, skip_special_tokens=False)

    def decode_delta(self, all_ids: list[int], num_previous: int) -> str:
        """Text added by ids[num_previous:], holding back an incomplete UTF-8 tail."""
        before = self.decode(all_ids[:num_previous])
        after = self.decode(all_ids)
        if after.endswith("\ufffd"):
            return ""
        return after[len(before) :] if after.startswith(before) else after
