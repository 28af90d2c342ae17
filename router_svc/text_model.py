"""The router's tokenizer and special token ids, loaded without torch.

The router reads only `tokenizer.json` (through the `tokenizers` package, via
`dsv4.text.tokenizer.TextCodec`, whose module imports no torch) and `config.json` for the
BOS/EOS ids. Which tokenizer, in order:
1. `model.tokenizer` (a tokenizer.json file or a directory holding one): missing is an error;
2. `model.path == "tiny"`: the deterministic tiny tokenizer (BOS 0, EOS 1);
3. `model.path` is a checkpoint directory with tokenizer.json;
4. otherwise none: text prompts are refused (send prompt_token_ids) and responses carry the
   workers' text, if they detokenize. The router pod often has no checkpoint, so this is a
   warning, not an error.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from dsv4.config import ModelSection
from dsv4.errors import CheckpointError
from dsv4.text.tokenizer import TextCodec, build_tokenizer
from router_svc.intake import max_token_bytes

logger = logging.getLogger(__name__)

# DeepSeek-V4 (and the tiny model) put BOS and EOS at ids 0 and 1.
DEFAULT_BOS_TOKEN_ID = 0
DEFAULT_EOS_TOKEN_ID = 1
TINY_VOCAB_SIZE = 1024  # dsv4.config.model.tiny_config().vocab_size


@dataclass(frozen=True)
class TextModel:
    """What the router needs to turn text into ids and back. Build it with `text_model`."""

    codec: TextCodec | None
    bos_token_id: int = DEFAULT_BOS_TOKEN_ID
    eos_token_id: int = DEFAULT_EOS_TOKEN_ID
    source: str = "none"  # for logs: where the tokenizer came from
    # Every token covers at most this many bytes of prompt text (0: no sound bound), so a
    # prompt longer than max_model_len * max_token_bytes bytes cannot fit (intake.py).
    max_token_bytes: int = 0
    tokenizer: Tokenizer | None = field(default=None, repr=False, compare=False)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`codec.encode(text)` that lets go of the GIL: `Tokenizer.encode` holds it for the
        whole call, `encode_batch` releases it, so a thread tokenizing a long prompt does not
        stall the router's event loop. Same ids; `add_special_tokens` (vLLM's /tokenize
        option) lets the tokenizer's post-processor add its own (a BOS, ...), as
        `Tokenizer.encode` does; prompts are fed without them."""
        assert self.codec is not None, "no tokenizer: text prompts are refused before this"
        tokenizer = self.tokenizer or self.codec.tokenizer
        return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def prompt_text(self, ids: list[int]) -> str:
        """`codec.prompt_text(ids)` (special tokens spelled out) that lets go of the GIL, as
        `encode` does: `decode_batch` releases it, `decode` does not."""
        assert self.codec is not None, "no tokenizer: ids are refused before this"
        tokenizer = self.tokenizer or self.codec.tokenizer
        return tokenizer.decode_batch([ids], skip_special_tokens=False)[0]


def text_model(
    tokenizer: Tokenizer,
    bos_token_id: int = DEFAULT_BOS_TOKEN_ID,
    eos_token_id: int = DEFAULT_EOS_TOKEN_ID,
    source: str = "",
) -> TextModel:
    return TextModel(
        TextCodec(tokenizer),
        bos_token_id,
        eos_token_id,
        source,
        max_token_bytes=max_token_bytes(tokenizer),
        tokenizer=tokenizer,
    )


def _tokenizer_file(path: Path) -> Path:
    return path / "tokenizer.json" if path.is_dir() else path


def _special_ids(model_dir: Path) -> tuple[int, int]:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        return DEFAULT_BOS_TOKEN_ID, DEFAULT_EOS_TOKEN_ID
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{config_path} does not parse as JSON: {exc}") from exc
    eos = raw.get("eos_token_id", DEFAULT_EOS_TOKEN_ID)
    eos = eos[0] if isinstance(eos, list) and eos else eos
    bos = raw.get("bos_token_id", DEFAULT_BOS_TOKEN_ID)
    return (
        int(bos if bos is not None else DEFAULT_BOS_TOKEN_ID),
        int(eos if eos is not None else DEFAULT_EOS_TOKEN_ID),
    )


def load_text_model(model: ModelSection) -> TextModel:
    """Called once by the RouterServer at construction; raises CheckpointError when an
    explicitly configured tokenizer is missing or broken."""
    model_dir = Path(model.model_dir or model.path)
    bos, eos = _special_ids(model_dir) if model_dir.is_dir() else (0, 1)
    if model.tokenizer:
        path = _tokenizer_file(Path(model.tokenizer))
        if not path.is_file():
            raise CheckpointError(
                f"model.tokenizer = {model.tokenizer!r}: no tokenizer.json there; fix the path"
            )
        return text_model(_tokenizer_from_file(path), bos, eos, str(path))
    if model.path == "tiny":
        return text_model(build_tokenizer(TINY_VOCAB_SIZE), source="tiny")
    path = model_dir / "tokenizer.json"
    if path.is_file():
        return text_model(_tokenizer_from_file(path), bos, eos, str(path))
    logger.warning(
        "router: no tokenizer at %s; text prompts will be refused (send prompt_token_ids) "
        "and stop strings are left to the workers; set model.tokenizer to fix",
        path,
    )
    return TextModel(None, bos, eos)


def _tokenizer_from_file(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers package raises a bare Exception on bad JSON
        raise CheckpointError(f"{path} is not a valid tokenizer.json: {exc}") from exc
