"""File-backed workloads: ShareGPT-format JSON and Mooncake-format JSONL traces.

ShareGPT: a JSON list of `{"conversations": [{"from": "human", "value": ...},
{"from": "gpt", "value": ...}, ...]}`. Like `vllm bench serve`, the first turn is the prompt and
the second turn's length is the output length. Without a tokenizer, lengths are estimated as
ceil(chars / 4) and the prompt is sent as text (the router tokenizes it).

Mooncake trace: one JSON object per line, `{"timestamp": ms, "input_length": N,
"output_length": M, "hash_ids": [..]}`. Each hash id names one block of `block_size` tokens
(512 in the published traces); equal leading hash ids mean a shared prefix. The block for a
hash id is a deterministic function of (seed, hash id), so shared prefixes are really shared.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.workloads import LoadRequest, random_token_ids

CHARS_PER_TOKEN_ESTIMATE = 4
MOONCAKE_BLOCK_SIZE = 512
# vLLM's ShareGPT filters (used when no fixed output length is given).
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048

Encode = Callable[[str], Sequence[int]]


def load_tokenizer(path: str | Path) -> Any:
    """A `tokenizers.Tokenizer` from a tokenizer.json file or a directory holding one."""
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for a bad file
        raise ValueError(f"--tokenizer {path}: cannot load {file} ({exc})") from None


def read_dataset_text(path: str | Path) -> str:
    """The text of --dataset-path; ValueError naming the flag for a file that is not there, not
    readable or not UTF-8 (a bare errno or codec line named neither the flag nor the file)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--dataset-path {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"--dataset-path {path}: not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None


def estimate_num_tokens(text: str) -> int:
    """Rough token count when no tokenizer is given: ceil(chars / 4), at least 1."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN_ESTIMATE))


def load_sharegpt(
    path: str | Path,
    num_prompts: int,
    seed: int,
    fixed_output_len: int | None = None,
    encode: Encode | None = None,
    id_prefix: str = "req",
) -> list[LoadRequest]:
    """Up to `num_prompts` requests from a ShareGPT JSON file, shuffled with `seed`.

    With `encode` (a tokenizer), prompts are sent as token ids and lengths are exact; otherwise
    the prompt is sent as text and lengths are estimated. Entries with fewer than two turns, or
    outside vLLM's length filters, are skipped. Raises ValueError on a malformed file.
    """
    try:
        entries = json.loads(read_dataset_text(path))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--dataset-path {path}: not a ShareGPT JSON file ({exc})") from None
    if not isinstance(entries, list):
        raise ValueError(f"--dataset-path {path}: a ShareGPT file must hold a JSON list")
    pairs = []
    for entry in entries:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        if not all(isinstance(turn, dict) for turn in turns[:2]):
            continue  # a turn that is not {"from": ..., "value": ...}: skipped as malformed
        pairs.append((str(turns[0].get("value", "")), str(turns[1].get("value", ""))))
    order = np.random.default_rng(seed).permutation(len(pairs))
    out: list[LoadRequest] = []
    for idx in order:
        if len(out) >= num_prompts:
            break
        prompt, completion = pairs[int(idx)]
        ids = tuple(int(t) for t in encode(prompt)) if encode else None
        input_len = len(ids) if ids is not None else estimate_num_tokens(prompt)
        if fixed_output_len is not None:
            output_len = fixed_output_len
        else:
            output_len = len(encode(completion)) if encode else estimate_num_tokens(completion)
            if input_len < SHAREGPT_MIN_LEN or output_len < SHAREGPT_MIN_LEN:
                continue
            if (
                input_len > SHAREGPT_MAX_PROMPT_LEN
                or input_len + output_len > SHAREGPT_MAX_TOTAL_LEN
            ):
                continue
        out.append(
            LoadRequest(
                request_id=f"{id_prefix}-{len(out)}",
                input_len=input_len,
                output_len=output_len,
                prompt_token_ids=ids if ids else None,
                prompt_text=None if ids else prompt,
            )
        )
    return out


def _parse_trace_line(line: str, line_no: int, path: str | Path) -> dict:
    try:
        row = json.loads(line)
        if not isinstance(row, dict):
            raise TypeError(f"expected a JSON object, not a {type(row).__name__}")
        parsed = {
            "timestamp_ms": float(row.get("timestamp", 0.0)),
            "input_length": int(row["input_length"]),
            "output_length": max(1, int(row.get("output_length", 1))),
            "hash_ids": [int(h) for h in row.get("hash_ids", [])],
        }
        if not math.isfinite(parsed["timestamp_ms"]):
            raise ValueError(f"timestamp {parsed['timestamp_ms']} is not a finite number")
        if parsed["input_length"] < 1 or any(h < 0 for h in parsed["hash_ids"]):
            raise ValueError("input_length must be >= 1 and hash_ids >= 0")
        return parsed
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"--dataset-path {path}:{line_no}: bad Mooncake trace line: {exc}"
        ) from exc


def load_mooncake_trace(
    path: str | Path,
    num_prompts: int | None,
    vocab_size: int,
    seed: int,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    time_scale: float = 1.0,
    id_prefix: str = "req",
) -> list[LoadRequest]:
    """Requests from a Mooncake JSONL trace, ordered by timestamp.

    `arrival_offset_s` = (timestamp - first timestamp) / 1000 * time_scale (so time_scale 0.5
    replays twice as fast). The prompt is the concatenation of the hash ids' blocks, cut to
    `input_length`; tokens past the last hash id are random and private to the request.
    """
    rows = []
    for line_no, line in enumerate(read_dataset_text(path).splitlines(), start=1):
        if line.strip():
            rows.append(_parse_trace_line(line, line_no, path))
    rows.sort(key=lambda r: r["timestamp_ms"])
    if num_prompts is not None:
        rows = rows[:num_prompts]
    if not rows:
        return []
    first_ms = rows[0]["timestamp_ms"]
    blocks: dict[int, tuple[int, ...]] = {}
    tail_rng = np.random.default_rng([seed, 1 << 32])
    out: list[LoadRequest] = []
    for i, row in enumerate(rows):
        ids: list[int] = []
        for h in row["hash_ids"]:
            if len(ids) >= row["input_length"]:
                break
            if h not in blocks:
                blocks[h] = random_token_ids(
                    np.random.default_rng([seed, h]), block_size, vocab_size
                )
            ids.extend(blocks[h])
        if len(ids) < row["input_length"]:
            ids.extend(random_token_ids(tail_rng, row["input_length"] - len(ids), vocab_size))
        ids = ids[: row["input_length"]]
        out.append(
            LoadRequest(
                request_id=f"{id_prefix}-{i}",
                input_len=len(ids),
                output_len=row["output_length"],
                prompt_token_ids=tuple(ids),
                arrival_offset_s=(row["timestamp_ms"] - first_ms) / 1000.0 * time_scale,
            )
        )
    return out
