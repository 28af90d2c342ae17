"""Numerics of the served weight formats on the trained tiny model (issue 21 item 3).

    dsv4 train-tiny /tmp/trained --steps 240 --minutes 30
    python -m benchmarks.formats_numerics --model /tmp/trained \
        --out benchmarks/results/formats-numerics-tiny-trained-cpu.json

Every served path is compared with its exact baseline on the same weights, both loaded as a
worker loads them (`dsv4.model.weights.load_model` with the `features.*` switches, then
`set_linear_activations_`), in fp32 on the CPU unless the path says bf16:

- `fp8_linears`: `linear_weights=checkpoint` (e4m3 + 128x128 UE8M0 scales) against the same
  checkpoint dequantised at load. Exact by construction (docs/model.md#fp8-linears).
- `mxfp4_experts`: `expert_weights=checkpoint` against the dequantised load. Exact likewise.
- `w8a8` / `w8a8_bf16`: `linear_activations=fp8` (activations rounded to e4m3 per 1x128 group)
  against `linear_weights=checkpoint` with exact activations. On the torch reference (CPU) every
  row count is quantised, prompts included; the CUDA kernel quantises only 3-64 rows, so this is
  the switch's worst case.
- `bf16_vs_fp32`: the yardstick: the same (trained) weights computed in bf16 against fp32.
- `v4_storage`: what storing the trained bf16 weights in V4's formats costs: the trained
  checkpoint re-stored with FP8 linears and MXFP4 experts (dequantised at load) against it;
  `v4_storage_linears` / `v4_storage_experts`: the FP8 linears alone, the MXFP4 experts alone.

Metrics, candidate against reference, over `--prompts` windows of `--prompt-len` tokens of the
held-out stdlib module (teacher-forced, the reference forward): layer 0's output streams (the
same embedding goes in on both sides, so one layer's error alone): max abs error and relative
L2 error (||y - y_ref|| / ||y_ref||), beside the reference's largest |y|; the logits: max abs,
relative L2, mean KL(p_ref || p) in nats, argmax agreement. `greedy_agree`: each prompt's `--tokens` greedy
tokens through a worker's engine built by `build_worker_runtime` with the path's switches,
the fraction kept: the tokens before the first one that differs from the reference's, summed
over prompts, over prompts x tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.runtime_tokens import runtime_greedy_tokens
from dsv4.commands.train_tiny import HELDOUT_MODULE, save_checkpoint, stdlib_tokens, train_tiny
from dsv4.config import load_config
from dsv4.config.model import ModelConfig, tiny_config
from dsv4.errors import Dsv4Error
from dsv4.model.fp8 import set_linear_activations_
from dsv4.model.tiny import write_checkpoint
from dsv4.model.weights import load_model
from dsv4.worker.build import build_worker_runtime

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FIELDS = ("path", "layer_max_err", "layer_rel_err", "logits_max_err", "logits_rel_err",
          "kl_nats", "argmax_agree", "greedy_agree", "prompts", "tokens", "device")  # fmt: skip


@dataclass(frozen=True)
class Side:
    """One served configuration: which checkpoint ("trained": as `dsv4 train-tiny` stores it,
    bf16 weights; "v4": the same weights in V4's formats), the model dtype and the switches."""

    checkpoint: str
    dtype: str = "fp32"
    linear_weights: str = "bf16"
    expert_weights: str = "bf16"
    linear_activations: str = "bf16"

    def label(self) -> str:
        return (f"{self.checkpoint} {self.dtype} linears={self.linear_weights} "
                f"experts={self.expert_weights} activations={self.linear_activations}")  # fmt: skip


V4 = Side("v4")
V4_LINEARS = Side("v4", linear_weights="checkpoint")
V4_LINEARS_BF16 = Side("v4", "bf16", linear_weights="checkpoint")
# path name -> (reference, candidate)
PATHS: dict[str, tuple[Side, Side]] = {
    "fp8_linears": (V4, V4_LINEARS),
    "mxfp4_experts": (V4, Side("v4", expert_weights="checkpoint")),
    "w8a8": (V4_LINEARS, Side("v4", linear_weights="checkpoint", linear_activations="fp8")),
    "w8a8_bf16": (V4_LINEARS_BF16, Side("v4", "bf16", "checkpoint", linear_activations="fp8")),
    "bf16_vs_fp32": (Side("trained"), Side("trained", "bf16")),
    "v4_storage": (Side("trained"), V4),
    "v4_storage_linears": (Side("trained"), Side("v4_linears")),
    "v4_storage_experts": (Side("trained"), Side("v4_experts")),
}


def prepare_checkpoints(model: Path | None, work: Path, train_steps: int,
                        dry_run: bool) -> dict[str, Path]:  # fmt: skip
    """{"trained": the `dsv4 train-tiny` checkpoint (`model`, else trained into `work`, or a
    random tiny one for a dry run), and its weights re-stored in V4's formats: "v4" (FP8 linears
    + MXFP4 experts, as V4-Flash ships), "v4_linears" / "v4_experts" (one of the two)}."""
    trained = model or work / ("random" if dry_run else "trained")
    if model is None and not (trained / "config.json").exists():
        if dry_run:
            write_checkpoint(trained, tiny_config(), seed=0)
        else:
            train_tiny(trained, minutes=60.0, steps=train_steps)
    weights, cfg = load_model(trained)
    checkpoints = {"trained": trained}
    for name, linears, experts in (("v4", "fp8", "fp4"), ("v4_linears", "fp8", "bf16"),
                                   ("v4_experts", "bf16", "fp4")):  # fmt: skip
        checkpoints[name] = work / name
        formats = cfg.with_overrides(linear_dtype=linears, expert_dtype=experts)
        save_checkpoint(weights, formats, checkpoints[name])
    return checkpoints


def load_side(side: Side, checkpoints: dict[str, Path]) -> torch.nn.Module:
    """The model as a worker serving `side` holds it (dsv4.worker.build's load + W8A8 switch)."""
    model, _ = load_model(checkpoints[side.checkpoint], dtype=DTYPES[side.dtype],
                          expert_weights=side.expert_weights,
                          linear_weights=side.linear_weights)  # fmt: skip
    set_linear_activations_(model, side.linear_activations)
    return model


@torch.no_grad()
def forward_outputs(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [N, L] -> (layer 0's output streams [N, L, M, D], logits [N, L, V]), both fp32."""
    seen: list[torch.Tensor] = []
    hook = model.layers[0].register_forward_hook(lambda _m, _a, out: seen.append(out.float()))
    try:
        logits = model(ids).logits.float()
    finally:
        hook.remove()
    return seen[0], logits


def compare(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """(max abs error, relative L2 error) of `got` against `ref`."""
    diff = (got - ref).double()
    return diff.abs().max().item(), (diff.norm() / ref.double().norm()).item()


def logit_metrics(ref: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    """Logits [..., V]: max / relative error, mean KL(p_ref || p) (nats), argmax agreement."""
    max_err, rel_err = compare(ref, got)
    ref_lp, got_lp = F.log_softmax(ref.double(), -1), F.log_softmax(got.double(), -1)
    kl = (ref_lp.exp() * (ref_lp - got_lp)).sum(-1).mean().item()
    agree = (ref.argmax(-1) == got.argmax(-1)).double().mean().item()
    return {"logits_max_err": max_err, "logits_rel_err": rel_err, "kl_nats": kl,
            "argmax_agree": agree}  # fmt: skip


def greedy_tokens(side: Side, checkpoints: dict[str, Path], prompts: list[list[int]],
                  tokens: int, forward: str) -> list[list[int]]:  # fmt: skip
    """Greedy continuations from a worker's engine built with `side`'s switches (`forward`:
    `features.forward`; the cache in the served formats, bf16 KV rows on the CPU)."""
    overrides = {
        "features.forward": forward,
        "model.path": str(checkpoints[side.checkpoint]), "model.dtype": side.dtype,
        "model.device": "cpu", "features.linear_weights": side.linear_weights,
        "features.expert_weights": side.expert_weights,
        "features.linear_activations": side.linear_activations,
        "cache.num_blocks": 64 * len(prompts), "cache.block_size": 128,
        "scheduler.max_num_seqs": len(prompts),
    }  # fmt: skip
    runtime = build_worker_runtime(load_config(overrides), with_transport=False)
    return runtime_greedy_tokens(runtime, prompts, tokens)


def kept_fraction(ref: list[list[int]], got: list[list[int]]) -> float:
    """Tokens before each row's first difference, summed, over all reference tokens."""
    kept = 0
    for want, have in zip(ref, got):
        same = [a == b for a, b in zip(want, have)] + [False]
        kept += same.index(False)
    return kept / sum(len(r) for r in ref)


def heldout_prompts(num: int, length: int, vocab_size: int) -> list[list[int]]:
    """`num` windows of `length` tokens spread evenly over the held-out module."""
    text = stdlib_tokens((HELDOUT_MODULE,), vocab_size).tolist()
    stride = (len(text) - length) // num
    return [text[i * stride : i * stride + length] for i in range(num)]


def measure(paths: list[str], checkpoints: dict[str, Path], prompts: list[list[int]],
            tokens: int, forward: str, device: str) -> list[dict]:  # fmt: skip
    """One `formats_numerics` record a path; each side's outputs and tokens computed once."""
    ids = torch.tensor(prompts)
    outputs: dict[Side, tuple[torch.Tensor, torch.Tensor]] = {}
    greedy: dict[Side, list[list[int]]] = {}
    records = []
    for name in paths:
        started = time.monotonic()
        for side in PATHS[name]:
            if side not in outputs:
                outputs[side] = forward_outputs(load_side(side, checkpoints), ids)
                greedy[side] = greedy_tokens(side, checkpoints, prompts, tokens, forward)
        ref, got = PATHS[name]
        layer_max, layer_rel = compare(outputs[ref][0], outputs[got][0])
        record = {
            "name": "formats_numerics", "path": name, "reference": ref.label(),
            "candidate": got.label(), "layer_max_err": layer_max, "layer_rel_err": layer_rel,
            **logit_metrics(outputs[ref][1], outputs[got][1]),
            "layer_ref_absmax": outputs[ref][0].abs().max().item(),
            "logits_ref_absmax": outputs[ref][1].abs().max().item(),
            "greedy_agree": kept_fraction(greedy[ref], greedy[got]), "prompts": len(prompts),
            "prompt_len": len(prompts[0]), "tokens": tokens, "forward": forward, "device": device,
            "seconds": round(time.monotonic() - started, 1),
        }  # fmt: skip
        print(json.dumps(record), flush=True)
        records.append(record)
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, help="a `dsv4 train-tiny` checkpoint (default: "
                    "trained into --work-dir for --train-steps, once)")  # fmt: skip
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/dsv4-formats-numerics"))
    ap.add_argument("--train-steps", type=int, default=240, help="steps, not minutes: the same "
                    "model on any machine (`dsv4 train-tiny DIR --steps 240`)")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens a prompt")
    ap.add_argument(
        "--paths", default=",".join(PATHS), help="comma-separated, of: " + ", ".join(PATHS)
    )
    ap.add_argument("--forward", default="paged", choices=("paged", "reference"),
                    help="the greedy engine's features.forward (paged: as served on CUDA)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dry-run", action="store_true",
                    help="a random tiny checkpoint, 2 prompts x 16 tokens, 4 greedy tokens")  # fmt: skip
    args = ap.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        ap.error(f"--paths {','.join(unknown)}: use some of {', '.join(PATHS)}")
    if args.dry_run:
        args.prompts, args.prompt_len, args.tokens = 2, 16, 4
    torch.set_num_threads(args.threads)
    try:
        checkpoints = prepare_checkpoints(args.model, args.work_dir, args.train_steps, args.dry_run)
        vocab = ModelConfig.from_file(checkpoints["trained"]).vocab_size
        prompts = heldout_prompts(args.prompts, args.prompt_len, vocab)
        device = f"cpu ({platform.machine()}, {args.threads} threads, torch {torch.__version__})"
        records = measure(paths, checkpoints, prompts, args.tokens, args.forward, device)
    except Dsv4Error as exc:  # a bad --model or setting: one line, no traceback
        print(f"formats_numerics: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
