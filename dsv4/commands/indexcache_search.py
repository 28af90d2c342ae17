"""`dsv4 indexcache-search`: pick an IndexCache pattern by the paper's training-free greedy search.

IndexCache (arXiv 2603.12201, `dsv4.model.index_cache`): start with every ratio-4 layer Full;
while more than `--budget` layers are Full, try switching each Full layer (but the first) to
Shared, keep the switch that raises the LM loss on a calibration text the least, repeat.
Alongside, from the all-Full forward, it reports for every pair of ratio-4 layers how much
their top-k sets overlap (what makes sharing cheap), per query:
  overlap = |A ∩ B| / |A|  (A, B: the valid selected entries; |A| = |B| = min(k, available)),
  jaccard = |A ∩ B| / |A ∪ B|,
averaged over all queries and over the "contested" ones (more available entries than k, so
the indexer actually chose). Output: a JSON report on stdout and optionally `--out FILE`.

    dsv4 indexcache-search --model DIR --calib FILE|stdlib --budget N_FULL [--out report.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dsv4.config.index_pattern import SHARED, IndexPattern
from dsv4.errors import UsageError
from dsv4.model.index_cache import TopkRelay

if TYPE_CHECKING:  # torch is imported where it is used: `dsv4 --help` stays light
    import torch

    from dsv4.model.deepseek_v4 import DeepseekV4

# Calibration text that exists on every machine: a few Python standard-library sources.
STDLIB_MODULES = ("textwrap", "difflib", "argparse", "string", "json.decoder")


def stdlib_text() -> str:
    import importlib

    sources = []
    for name in STDLIB_MODULES:
        path = getattr(importlib.import_module(name), "__file__", None)
        if path:
            sources.append(Path(path).read_text(encoding="utf-8"))
    return "\n".join(sources)


def calibration_text(calib: str) -> str:
    """--calib's text ('stdlib': `stdlib_text`); a file that is not UTF-8 is a usage error."""
    if calib == "stdlib":
        return stdlib_text()
    try:
        return Path(calib).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"--calib {calib}: not UTF-8 text ({exc.reason} at byte {exc.start}); give a text file"
        ) from exc


def calibration_ids(model_dir: str, text: str, vocab_size: int, max_tokens: int) -> list[int]:
    """Token ids of the calibration text (the checkpoint's tokenizer, else bytes mod vocab)."""
    from dsv4.text.tokenizer import TextCodec

    codec = TextCodec.from_dir_if_present(model_dir)
    # A checkpoint without tokenizer.json: raw bytes.
    ids = codec.encode(text) if codec else [b % vocab_size for b in text.encode()]
    return ids[:max_tokens]


def segments(ids: list[int], seq_len: int) -> torch.Tensor:
    """Non-overlapping [n, seq_len] rows (each a forward from position 0); the tail is dropped."""
    import torch

    n = len(ids) // seq_len
    if n == 0:
        raise UsageError(
            f"--seq-len {seq_len}: the calibration text has only {len(ids)} tokens (--max-tokens,"
            " --calib): lower --seq-len or give more text"
        )
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


Recorded = dict[int, list["torch.Tensor"]]  # ratio-4 layer id -> per calibration row [S, k]


def lm_loss(
    model: DeepseekV4,
    batch: torch.Tensor,
    pattern: IndexPattern,
    rows_per_forward: int,
    record: Recorded | None = None,
) -> float:
    """Mean next-token cross entropy of `batch` [n, S] under `pattern`; with `record`, every
    Full layer's top-k of every row is appended to it."""
    import torch

    total, count = 0.0, 0
    for chunk in batch.split(rows_per_forward):
        relay = TopkRelay(pattern, record=record is not None)
        with torch.no_grad():
            logits = model(chunk, topk_relay=relay).logits  # [b, S, V] fp32
        ce = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"
        )
        total, count = total + float(ce), count + chunk[:, 1:].numel()
        for layer_id, rows in relay.recorded.items():
            record.setdefault(layer_id, []).extend(rows[r] for r in sorted(rows))
    return total / count


def topk_overlap(a: torch.Tensor, b: torch.Tensor, ratio: int, topk: int) -> dict[str, float]:
    """a, b [S, k] local entry indices (-1 padded) of the same queries (positions 0..S-1)."""
    import torch

    n = int(max(a.max(), b.max(), 0)) + 2
    dummy = n - 1

    def onehot(idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(idx.shape[0], n, dtype=torch.bool)
        out.scatter_(1, torch.where(idx >= 0, idx, dummy), True)
        return out[:, :dummy]

    oa, ob = onehot(a), onehot(b)
    inter = (oa & ob).sum(-1).float()
    size = oa.sum(-1).float()
    union = (oa | ob).sum(-1).float()
    has = size > 0
    available = (torch.arange(a.shape[0]) + 1) // ratio
    contested = has & (available > topk)
    ov, jac = inter / size.clamp(min=1), inter / union.clamp(min=1)
    return {
        "overlap": float(ov[has].mean()) if has.any() else 1.0,
        "jaccard": float(jac[has].mean()) if has.any() else 1.0,
        "overlap_contested": float(ov[contested].mean()) if contested.any() else float("nan"),
        "jaccard_contested": float(jac[contested].mean()) if contested.any() else float("nan"),
        "num_queries": int(has.sum()),
        "num_contested": int(contested.sum()),
    }


def pair_overlaps(
    record: Recorded, layer_ids: tuple[int, ...], topk: int
) -> list[dict[str, object]]:
    """Every pair of ratio-4 layers, averaged over the recorded rows (equal weight per row)."""
    out = []
    for la, lb in itertools.combinations(layer_ids, 2):
        stats = [topk_overlap(a, b, 4, topk) for a, b in zip(record[la], record[lb])]
        merged: dict[str, object] = {"layers": [la, lb]}
        for key in ("overlap", "jaccard", "overlap_contested", "jaccard_contested"):
            values = [s[key] for s in stats if s[key] == s[key]]  # drop NaN
            merged[key] = round(sum(values) / len(values), 4) if values else None
        merged["num_contested"] = sum(s["num_contested"] for s in stats)
        out.append(merged)
    return out


def greedy_search(
    model: DeepseekV4, batch: torch.Tensor, budget: int, rows_per_forward: int = 4
) -> dict[str, object]:
    """The paper's greedy search down to `budget` Full layers; returns the report dict."""
    start = IndexPattern.all_full(model.cfg)
    if not start.layer_ids:
        raise UsageError("--model: the model has no ratio-4 layers, so there is nothing to share")
    if not 1 <= budget <= len(start.layer_ids):
        raise UsageError(
            f"--budget {budget}: give 1..{len(start.layer_ids)} (the model's ratio-4 layers)"
        )
    record: Recorded = {}
    base_loss = lm_loss(model, batch, start, rows_per_forward, record)
    pattern, steps = start, []
    while pattern.num_full > budget:
        trials = {}
        for layer_id in pattern.full_layer_ids[1:]:  # the first ratio-4 layer stays Full
            candidate = pattern.with_role(layer_id, SHARED)
            trials[layer_id] = lm_loss(model, batch, candidate, rows_per_forward)
        best = min(trials, key=trials.__getitem__)
        pattern = pattern.with_role(best, SHARED)
        steps.append(
            {
                "shared_layer": best,
                "pattern": pattern.roles,
                "loss": round(trials[best], 6),
                "trials": {str(k): round(v, 6) for k, v in trials.items()},
            }
        )
    return {
        "c4_layers": list(start.layer_ids),
        "budget": budget,
        "num_tokens": int(batch.numel()),
        "seq_len": int(batch.shape[1]),
        "loss_all_full": round(base_loss, 6),
        "steps": steps,
        "pattern": pattern.roles,
        "loss": round(steps[-1]["loss"], 6) if steps else round(base_loss, 6),
        "topk_overlap": pair_overlaps(record, start.layer_ids, model.cfg.index_topk),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--calib", default="stdlib", help="calibration text file, or 'stdlib'")
    p.add_argument("--budget", type=int, required=True, help="Full ratio-4 layers to keep")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration row")
    p.add_argument("--max-tokens", type=int, default=4096, help="calibration tokens used")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="", help="also write the JSON report here")


def _check_args(args: argparse.Namespace) -> None:
    """What can be checked before the model loads (minutes for a large one)."""
    import torch

    for flag, value in (("--budget", args.budget), ("--seq-len", args.seq_len),
                        ("--max-tokens", args.max_tokens)):  # fmt: skip
        if value < 1:
            raise UsageError(f"{flag} {value}: give a positive count")
    if args.calib != "stdlib" and not Path(args.calib).is_file():
        raise UsageError(f"--calib {args.calib}: no such file; give a text file or 'stdlib'")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise UsageError(f"--out {args.out}: its directory does not exist")
    if args.out and Path(args.out).is_dir():
        raise UsageError(f"--out {args.out}: a directory; give a file name for the JSON report")
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        raise UsageError(f"--device {args.device}: {exc}; use cpu or cuda:N") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: no CUDA device here; use --device cpu")


def run(args: argparse.Namespace) -> int:
    import torch

    from dsv4.model.weights import load_model

    _check_args(args)
    text = calibration_text(args.calib)  # before the model loads (minutes for a large one)
    model, cfg = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    ids = calibration_ids(args.model, text, cfg.vocab_size, args.max_tokens)
    batch = segments(ids, min(args.seq_len, cfg.max_position_embeddings)).to(args.device)
    report = {
        "model": str(args.model),
        "calib": args.calib,
        **greedy_search(model, batch, args.budget),
    }
    text = json.dumps(report, indent=1)
    print(text, flush=True)  # first: a failed --out write must not lose the search's result
    if args.out:
        try:
            Path(args.out).write_text(text + "\n")
        except OSError as exc:
            raise UsageError(f"--out {args.out}: cannot write the report ({exc.strerror}); "
                             "it is on stdout") from None  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsv4 indexcache-search", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
