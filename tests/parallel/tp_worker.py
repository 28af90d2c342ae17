"""One rank of the tensor/expert-parallel tests: `python -m tests.parallel.tp_worker ...`.

Builds the deterministic tiny model, shards it over the group, runs `run_workload` and saves a
`RankReport` with torch.save. The parent runs the same `run_workload` on the unsharded model.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass

import torch

from dsv4.config.model import tiny_config
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.model.generate import generate
from dsv4.model.tiny import random_model
from dsv4.parallel import ExpertParallelMoE, close_group, init_cpu_group, shard_model

SEED = 3
PROMPT_LENGTHS = (1, 7, 130)
DECODE_LEN = 140  # crosses the window (32), C4 top-k saturation (> 64) and the 128 boundary
PREFILL_BOUNDS = (0, 5, 67, 130)  # then one token per step up to DECODE_LEN
NUM_GENERATED = 16


@dataclass(frozen=True)
class Workload:
    forward_logits: tuple[torch.Tensor, ...]  # one [S, V] per prompt length
    cached_logits: torch.Tensor  # [2, DECODE_LEN, V]: chunked prefill then decode, 2 rows
    generated: tuple[tuple[int, ...], ...]  # greedy tokens per generation prompt
    mtp_logits: torch.Tensor  # [S - 1, V]: MTP drafts from the longest prompt's streams


@dataclass(frozen=True)
class RankReport:
    rank: int
    expert_ids: dict[str, tuple[int, ...]]  # "layers.0" / "mtp.0" -> routed experts held
    num_expert_params: int  # routed-expert parameters held by this rank
    num_params: int
    workload: Workload | None  # rank 0 only


def prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1024, (length,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def run_workload(model: DeepseekV4) -> Workload:
    outs = [model(prompt(n, 100 + n)) for n in PROMPT_LENGTHS]
    longest = prompt(PROMPT_LENGTHS[-1], 100 + PROMPT_LENGTHS[-1])
    mtp = model.mtp_forward(outs[-1].streams[:-1], longest[1:]).logits  # [S - 1, V]
    rows = torch.stack((prompt(DECODE_LEN, 11), prompt(DECODE_LEN, 12)))  # [2, DECODE_LEN]
    states = [model.new_state(), model.new_state()]
    chunks = [
        model(rows[:, a:b], states=states).logits for a, b in itertools.pairwise(PREFILL_BOUNDS)
    ]
    for i in range(PREFILL_BOUNDS[-1], DECODE_LEN):
        chunks.append(model(rows[:, i : i + 1], states=states).logits)
    generated = tuple(
        tuple(generate(model, prompt(n, 200 + n).tolist(), NUM_GENERATED)) for n in (1, 7)
    )
    forward = tuple(out.logits for out in outs)
    return Workload(forward, torch.cat(chunks, dim=1), generated, mtp)


def expert_inventory(model: DeepseekV4) -> tuple[dict[str, tuple[int, ...]], int]:
    """({"layers.0": routed expert ids held, ..., "mtp.0": ...}, routed-expert parameters)."""
    held = {
        name.removesuffix(".ffn"): tuple(sorted(int(e) for e in module.experts))
        for name, module in model.named_modules()
        if isinstance(module, ExpertParallelMoE)
    }
    count = sum(p.numel() for n, p in model.named_parameters() if ".ffn.experts." in n)
    return held, count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    group = init_cpu_group(args.rank, args.world_size, args.port, timeout_s=args.timeout_s)
    try:
        model = shard_model(random_model(tiny_config(), SEED), group)
        workload = run_workload(model)
        held, count = expert_inventory(model)
        num_params = sum(p.numel() for p in model.parameters())
        report = RankReport(
            args.rank, held, count, num_params, workload if args.rank == 0 else None
        )
        torch.save(report, args.out)
    finally:
        close_group(group)


if __name__ == "__main__":
    # NOTE: run main from the module's importable name, so torch.save pickles RankReport as
    # tests.parallel.tp_worker.RankReport (the parent cannot load __main__.RankReport).
    from tests.parallel import tp_worker

    tp_worker.main()
