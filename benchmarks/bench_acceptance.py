"""MTP acceptance per draft position of the trained tiny model (`dsv4 train-tiny`), measured
through the paged speculator on held-out text: the rates `benchmarks/bench_decode_graphs.py` turns
step times into TPOT with.

    dsv4 train-tiny /tmp/trained --minutes 8
    python -m benchmarks.bench_acceptance --model /tmp/trained --out benchmarks/results/mtp-acceptance.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dsv4.commands.train_tiny import HELDOUT_MODULE, stdlib_tokens
from dsv4.engine.acceptance import measure_acceptance
from dsv4.model.weights import load_model
from dsv4.types import SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    model, cfg = load_model(args.model, dtype=torch.float32)
    text = stdlib_tokens((HELDOUT_MODULE,), cfg.vocab_size).tolist()
    stride = (len(text) - args.prompt_len) // args.num_prompts
    prompts = [text[i * stride : i * stride + args.prompt_len] for i in range(args.num_prompts)]
    records = []
    for label, sampling in (("greedy", None), ("T=1", SamplingParams(temperature=1.0, seed=7)),
                            ("T=0.7", SamplingParams(temperature=0.7, seed=7))):  # fmt: skip
        started = time.monotonic()
        metrics, _ = measure_acceptance(model, prompts, args.k, args.new_tokens, sampling,
                                        paged=True)  # fmt: skip
        record = {"sampling": label, "k": args.k, **metrics.as_dict(),
                  "seconds": round(time.monotonic() - started, 1)}  # fmt: skip
        print(json.dumps(record), flush=True)
        records.append(record)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
