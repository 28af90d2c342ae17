"""Correctness on one GPU: a worker engine of T ranks (gloo, all on the one card) gives the same
greedy tokens as one rank (issue 26). Not a benchmark: no timing, only token equality.

    python -m benchmarks.ranks_check --out $OUT/ranks_check.json            # one H200
    python -m benchmarks.ranks_check --device cpu --kernels ref             # CPU rehearsal

For each forward (`--forwards reference,paged`), kernel backend (`--kernels ref,triton`) and
expert split (`--experts ep,tp`): build the engine exactly as a worker does
(`build_worker_runtime`, tiny model with o_groups 4, fp32 weights and KV so that the only
difference is the order of the all-reduce's fp32 sums; `fp32_overrides`) with 1 rank and with
`--ranks` ranks (`model.distributed_backend gloo`: NCCL refuses two ranks on one GPU; the
paged forward then runs its decode steps eager, as graphs cannot capture gloo; one rank runs
eager too: the fp32 expert reference syncs, which a capture refuses), serve the same greedy
prompts, and compare. Writes one record per combination; exit 1 on any mismatch or error (the record
says which).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

PROMPTS = ([5, 9, 200, 17, 33, 41, 7, 300, 12, 99, 4, 8], list(range(2, 150)), [700, 3, 81])
MAX_NEW_TOKENS = 8


@dataclass(frozen=True)
class Case:
    device: str
    forward: str  # "reference" | "paged"
    kernels: str  # "ref" | "triton"
    experts: str  # "ep": whole per rank; "tp": every expert sliced over the ranks


def tiny_ranked_checkpoint(directory: Path) -> Path:
    """Two layers (ratios 0 and 4), o_groups 4: splits over 1, 2 and 4 ranks."""
    from dsv4.model.tiny import shape_config, write_checkpoint

    cfg = shape_config("tiny", "fp8", "fp4")
    cfg = cfg.with_overrides(num_hidden_layers=2, compress_ratios=(0, 4), o_groups=4)
    return write_checkpoint(directory / "tiny-ogroups4", cfg, seed=0)


def greedy_tokens(model_dir: Path, case: Case, ranks: int) -> list[list[int]]:
    from benchmarks.runtime_tokens import runtime_greedy_tokens
    from dsv4.config import load_config
    from dsv4.worker.build import build_worker_runtime

    config = load_config({
        "model.path": str(model_dir), "model.device": case.device, "model.dtype": "fp32",
        "model.kernels": case.kernels, "model.tensor_parallel_size": ranks,
        "model.expert_parallel": case.experts == "ep",
        "model.distributed_backend": "gloo", "features.forward": case.forward,
        "cache.kv_dtype": "fp32", "cache.indexer_key_dtype": "fp32", "cache.num_blocks": 64,
        "cache.block_size": 128, "scheduler.max_num_batched_tokens": 512,
        "model.max_model_len": 1024, "model.kernel_overrides": fp32_overrides(case),
        "features.cuda_graphs": False,
    }, None, {})  # fmt: skip
    runtime = build_worker_runtime(config, with_transport=False, name=f"ranks{ranks}")
    try:
        return runtime_greedy_tokens(runtime, PROMPTS, MAX_NEW_TOKENS)
    finally:
        if runtime.ranks is not None:
            runtime.ranks.close()


def fp32_overrides(case: Case) -> tuple[str, ...]:
    """The paged forward's two Triton kernels that take bf16 only (the compressor rounds its
    entries to bf16, the grouped expert GEMM is bf16) run their references in this fp32 check;
    every other op of the case's backend runs as served."""
    if case.forward == "paged" and case.kernels == "triton":
        return ("compressor_step=ref", "moe_experts=ref")
    return ()


def check(model_dir: Path, case: Case, ranks: int, one_rank: dict) -> dict:
    """One record; `one_rank` caches the 1-rank tokens per (forward, kernels): one rank holds
    every expert whole, whatever the split."""
    record: dict = {**asdict(case), "ranks": ranks, "backend": "gloo"}
    try:
        key = (case.forward, case.kernels)
        if key not in one_rank:
            one_rank[key] = greedy_tokens(model_dir, case, 1)
        one = one_rank[key]
        many = greedy_tokens(model_dir, case, ranks)
        record |= {"equal": one == many, "tokens_1_rank": one, f"tokens_{ranks}_ranks": many}
    except Exception as exc:  # recorded: the other backends still run
        record |= {"equal": False, "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (one GPU) or cpu")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--kernels", default="ref,triton", help="comma-separated backends")
    parser.add_argument("--forwards", default="reference,paged", help="comma-separated forwards")
    parser.add_argument("--experts", default="ep,tp", help="ep (whole per rank), tp (sliced)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "."))
                        / "ranks_check.json")  # fmt: skip
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ranks-check-") as tmp:
        model_dir = tiny_ranked_checkpoint(Path(tmp))
        cases = [Case(args.device, f, k, e) for f in args.forwards.split(",")
                 for k in args.kernels.split(",") for e in args.experts.split(",")]  # fmt: skip
        one_rank: dict = {}
        records = [check(model_dir, case, args.ranks, one_rank) for case in cases]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    for r in records:
        print(f"{r['device']} {r['forward']} kernels={r['kernels']} experts={r['experts']} "
              f"1 vs {r['ranks']} ranks (gloo): "
              f"{'EQUAL' if r['equal'] else 'DIFFERENT'} {r.get('error', '')}")  # fmt: skip
    print(f"wrote {args.out}")
    return 0 if all(r["equal"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
