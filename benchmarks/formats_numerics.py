"""Numerics of the served weight formats on the trained tiny model (issue 21 item 3).

    dsv4 train-tiny /tmp/trained --steps 240 --minutes 30
    python -m benchmarks.formats_numerics --model /tmp/trained \
        --out benchmarks/results/formats-numerics-tiny-trained-cpu.json
    # experts that take mxfp4_layout halves128 (I = 128): every path, the halves ones too
    dsv4 train-tiny /tmp/trained-i128 --steps 240 --minutes 30 --moe-intermediate-size 128
    python -m benchmarks.formats_numerics --model /tmp/trained-i128 \
        --out benchmarks/results/formats-numerics-tiny-trained-i128-cpu.json

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
- `mxfp4_halves128`: `mxfp4_layout=halves128` (the MXFP4 codes re-packed at load) against the
  stored layout, both `expert_weights=checkpoint`. Exact (the same codes, unpacked per call).
- `w4a8` / `w4a8_bf16`: `moe_activations=fp8` (W4A8: x and the SwiGLU output h rounded to e4m3
  per 1x128 group, the weights fed as `dsv4.ops.w4a8.w4a8_weight`s) against exact halves128
  experts. The teacher-forced side serves every MoE call through W4A8 (`W4A8Experts`, the
  torch reference kernels.moe checks its kernel against); the engine, as served, keeps steps of
  at most 0.75 pairs an expert exact (the GEMV's sizes: `kernels.moe.uses_w4a8`). W4A8 rounds
  the gate, up and output products to bf16 even in an fp32 model, so `w4a8_bf16` isolates the
  e4m3 rounding. These three need experts of whole 128-column blocks (`halves_fit`: the
  default tiny I = 64 is not): named on such a model they are refused, left to the default they
  are skipped with a note, never reported as a misleading exact 0.
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
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.runtime_tokens import runtime_greedy_tokens
from dsv4.commands.train_tiny import (
    HELDOUT_MODULE,
    save_checkpoint,
    stdlib_tokens,
    tiny_train_config,
    train_tiny,
)
from dsv4.config import load_config
from dsv4.config.model import ModelConfig
from dsv4.errors import Dsv4Error, UsageError
from dsv4.model.fp8 import set_linear_activations_
from dsv4.model.moe import MXFP4_LAYOUTS, MoE, halves_fit, mxfp4_layout_
from dsv4.model.tiny import write_checkpoint
from dsv4.model.weights import load_model
from dsv4.ops.quant import halves_block, unpack_halves
from dsv4.ops.w4a8 import w4a8_swiglu, w4a8_weight
from dsv4.worker.build import WorkerRuntime, build_worker_runtime

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FIELDS = ("path", "layer_max_err", "layer_rel_err", "logits_max_err", "logits_rel_err",
          "kl_nats", "argmax_agree", "greedy_agree", "prompts", "tokens", "device")  # fmt: skip
HALVES = MXFP4_LAYOUTS["halves128"]  # "mxfp4_halves128": the format the halves paths must hold


class NumericsError(Dsv4Error):
    """A path did not run as named (its experts not held as it needs, or a rounding switch that
    left the outputs bit-identical): refused rather than reported as an exact 0."""


@dataclass(frozen=True)
class Side:
    """One served configuration: which checkpoint ("trained": as `dsv4 train-tiny` stores it,
    bf16 weights; "v4": the same weights in V4's formats), the model dtype and the switches."""

    checkpoint: str
    dtype: str = "fp32"
    linear_weights: str = "bf16"
    expert_weights: str = "bf16"
    linear_activations: str = "bf16"
    mxfp4_layout: str = "stored"
    moe_activations: str = "bf16"

    def label(self) -> str:
        return (f"{self.checkpoint} {self.dtype} linears={self.linear_weights} "
                f"experts={self.expert_weights} activations={self.linear_activations} "
                f"layout={self.mxfp4_layout} moe_activations={self.moe_activations}")  # fmt: skip


V4 = Side("v4")
V4_LINEARS = Side("v4", linear_weights="checkpoint")
V4_LINEARS_BF16 = Side("v4", "bf16", linear_weights="checkpoint")
V4_EXPERTS = Side("v4", expert_weights="checkpoint")
V4_HALVES = replace(V4_EXPERTS, mxfp4_layout="halves128")
V4_HALVES_BF16 = replace(V4_HALVES, dtype="bf16")
# path name -> (reference, candidate)
PATHS: dict[str, tuple[Side, Side]] = {
    "fp8_linears": (V4, V4_LINEARS),
    "mxfp4_experts": (V4, V4_EXPERTS),
    "mxfp4_halves128": (V4_EXPERTS, V4_HALVES),
    "w8a8": (V4_LINEARS, Side("v4", linear_weights="checkpoint", linear_activations="fp8")),
    "w8a8_bf16": (V4_LINEARS_BF16, Side("v4", "bf16", "checkpoint", linear_activations="fp8")),
    "w4a8": (V4_HALVES, replace(V4_HALVES, moe_activations="fp8")),
    "w4a8_bf16": (V4_HALVES_BF16, replace(V4_HALVES_BF16, moe_activations="fp8")),
    "bf16_vs_fp32": (Side("trained"), Side("trained", "bf16")),
    "v4_storage": (Side("trained"), V4),
    "v4_storage_linears": (Side("trained"), Side("v4_linears")),
    "v4_storage_experts": (Side("trained"), Side("v4_experts")),
}
# paths that need experts of whole 128-column blocks (`halves_fit`)
HALVES_PATHS = ("mxfp4_halves128", "w4a8", "w4a8_bf16")
# paths whose candidate rounds activations: bit-identical outputs mean the switch did not act
ROUNDING_PATHS = ("w8a8", "w8a8_bf16", "w4a8", "w4a8_bf16")


def prepare_checkpoints(model: Path | None, work: Path, train_steps: int, dry_run: bool,
                        inter: int | None = None) -> dict[str, Path]:  # fmt: skip
    """{"trained": the `dsv4 train-tiny` checkpoint (`model`, else trained into `work`, or a
    random tiny one for a dry run; `inter`: their moe_intermediate_size, default the tiny
    shape's), and its weights re-stored in V4's formats: "v4" (FP8 linears + MXFP4 experts, as
    V4-Flash ships), "v4_linears" / "v4_experts" (one of the two)}."""
    name = ("random" if dry_run else "trained") + ("" if inter is None else f"-i{inter}")
    trained = model or work / name
    if model is None and not (trained / "config.json").exists():
        if dry_run:
            write_checkpoint(trained, model_config(None, inter), seed=0)
        else:
            train_tiny(trained, minutes=60.0, steps=train_steps, moe_intermediate_size=inter)
    weights, cfg = load_model(trained)
    checkpoints = {"trained": trained}
    for name, linears, experts in (("v4", "fp8", "fp4"), ("v4_linears", "fp8", "bf16"),
                                   ("v4_experts", "bf16", "fp4")):  # fmt: skip
        checkpoints[name] = work / name
        formats = cfg.with_overrides(linear_dtype=linears, expert_dtype=experts)
        save_checkpoint(weights, formats, checkpoints[name])
    return checkpoints


class W4A8Experts:
    """One MoE layer's halves128 MXFP4 experts served with W4A8 numerics to the reference
    forward, as its `ExpertStore` (`dsv4.model.moe`): `dsv4.ops.w4a8`, the torch reference of
    kernels/moe_w4a8.py, on every call (the reference forward has no W4A8 switch of its own)."""

    def __init__(self, moe: MoE) -> None:
        stacked = moe.stacked_experts
        if stacked is None or stacked.format != HALVES:
            held = "bf16" if stacked is None else stacked.format
            raise NumericsError(f"W4A8 reads experts held as {HALVES}; these are held as {held}")
        block, inter = halves_block(stacked.format), stacked.w13.shape[1] // 2
        self.limit = moe.cfg.swiglu_limit
        self.weights: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for e in range(stacked.w13.shape[0]):
            # fp32 w13 [2I, D], w2 [D, I]: the values the W4A8 MMA multiplies
            w13 = w4a8_weight(unpack_halves(stacked.w13[e], block), stacked.w13_scale[e])
            w2 = w4a8_weight(unpack_halves(stacked.w2[e], block), stacked.w2_scale[e])
            self.weights.append((w13[:inter], w2, w13[inter:]))

    def prepare(self, ids: torch.Tensor) -> None:
        """Every expert is resident: nothing to fetch."""
        del ids

    def expert(self, e: int, num_tokens: int):
        """Expert e: u [n, D] -> [n, D] bf16 (`w4a8_swiglu`)."""
        w1, w2, w3 = self.weights[e]
        return lambda u: w4a8_swiglu(u, w1, w2, w3, self.limit)


def load_side(side: Side, checkpoints: dict[str, Path]) -> torch.nn.Module:
    """The model as a worker serving `side` holds it (dsv4.worker.build's load + W8A8 switch;
    the paged forward's `mxfp4_layout_`; W4A8 through `W4A8Experts`)."""
    model, _ = load_model(checkpoints[side.checkpoint], dtype=DTYPES[side.dtype],
                          expert_weights=side.expert_weights,
                          linear_weights=side.linear_weights)  # fmt: skip
    set_linear_activations_(model, side.linear_activations)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        held = mxfp4_layout_(moe, side.mxfp4_layout)
        if side.mxfp4_layout == "halves128" and (held is None or held.format != HALVES):
            raise NumericsError(f"{side.label()}: experts held as "
                                f"{'bf16' if held is None else held.format}, not {HALVES}")  # fmt: skip
        if side.moe_activations == "fp8":
            moe.expert_store = W4A8Experts(moe)
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
        "features.mxfp4_layout": side.mxfp4_layout,
        "features.moe_activations": side.moe_activations,
        "cache.num_blocks": 64 * len(prompts), "cache.block_size": 128,
        "scheduler.max_num_seqs": len(prompts),
    }  # fmt: skip
    runtime = build_worker_runtime(load_config(overrides), with_transport=False)
    held = engine_expert_formats(runtime)
    if side.mxfp4_layout == "halves128" and held != {HALVES}:
        raise NumericsError(f"{side.label()}: the engine holds its experts as {sorted(held)}, "
                            f"not {HALVES}: W4A8 / halves128 would not run")  # fmt: skip
    return runtime_greedy_tokens(runtime, prompts, tokens)


def engine_expert_formats(runtime: WorkerRuntime) -> set[str]:
    """The formats the engine's paged forward holds its layers' routed experts in."""
    forward = runtime.engine.core.runner.forward
    paged = getattr(forward, "paged", None)
    if paged is None:  # the reference forward: no mxfp4_layout, no W4A8
        return {"reference forward"}
    return {lw.experts.format for lw in paged.weights}


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
        if name in ROUNDING_PATHS and layer_max == 0.0:
            raise NumericsError(f"{name}: {got.label()} gave layer 0 bit for bit as "
                                f"{ref.label()}: its activation switch did not act")  # fmt: skip
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


def model_config(model: Path | None, inter: int | None) -> ModelConfig:
    """The config of the model to measure, known before any training: `model`'s, else the
    tiny shape with moe_intermediate_size `inter`."""
    if model is not None:
        return ModelConfig.from_file(model)
    return tiny_train_config(inter)


def runnable_paths(paths: list[str], cfg: ModelConfig, forward: str, named: bool) -> list[str]:
    """`paths` less the halves ones where they cannot run: experts not whole 128-column blocks
    (`halves_fit`: halves128 keeps them stored, W4A8 runs exact), or the reference forward
    (no mxfp4_layout, no W4A8). `named` (--paths given): that is an error (UsageError);
    otherwise they are dropped with a note on stderr."""
    unfit = [p for p in paths if p in HALVES_PATHS]
    if not unfit:
        return paths
    if forward != "paged":
        why = f"--forward {forward}: mxfp4_layout and W4A8 act on the paged forward only"
    elif not halves_fit(cfg.hidden_size, cfg.moe_intermediate_size):
        why = (f"the experts (hidden {cfg.hidden_size}, moe_intermediate_size "
               f"{cfg.moe_intermediate_size}) are not whole 128-column blocks, so mxfp4_layout "
               "halves128 keeps them stored and W4A8 would run exact: use a model of I = 128 "
               "(`dsv4 train-tiny DIR --moe-intermediate-size 128`)")  # fmt: skip
    else:
        return paths
    if named:
        raise UsageError(f"--paths {','.join(unfit)}: {why}")
    print(f"formats_numerics: skipping {','.join(unfit)}: {why}", file=sys.stderr)
    return [p for p in paths if p not in HALVES_PATHS]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, help="a `dsv4 train-tiny` checkpoint (default: "
                    "trained into --work-dir for --train-steps, once)")  # fmt: skip
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/dsv4-formats-numerics"))
    ap.add_argument("--train-steps", type=int, default=240, help="steps, not minutes: the same "
                    "model on any machine (`dsv4 train-tiny DIR --steps 240`)")  # fmt: skip
    ap.add_argument("--moe-intermediate-size", type=int, default=None, help="without --model: "
                    "the trained (or dry-run) model's I (default the tiny 64; 128 takes the "
                    "halves paths)")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens a prompt")
    ap.add_argument("--paths", default="", help="comma-separated, of: " + ", ".join(PATHS)
                    + " (default: all the model can run)")  # fmt: skip
    ap.add_argument("--forward", default="paged", choices=("paged", "reference"),
                    help="the greedy engine's features.forward (paged: as served on CUDA)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dry-run", action="store_true",
                    help="a random tiny checkpoint, 2 prompts x 16 tokens, 4 greedy tokens")  # fmt: skip
    args = ap.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p] or list(PATHS)
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        ap.error(f"--paths {','.join(unknown)}: use some of {', '.join(PATHS)}")
    if args.model is not None and args.moe_intermediate_size is not None:
        ap.error("--moe-intermediate-size: only without --model (the model's config says its I)")
    if args.dry_run:
        args.prompts, args.prompt_len, args.tokens = 2, 16, 4
    torch.set_num_threads(args.threads)
    try:  # the paths checked against the model's shape first: no training for a refusal
        cfg = model_config(args.model, args.moe_intermediate_size)
        paths = runnable_paths(paths, cfg, args.forward, named=bool(args.paths))
        checkpoints = prepare_checkpoints(args.model, args.work_dir, args.train_steps,
                                          args.dry_run, args.moe_intermediate_size)  # fmt: skip
        prompts = heldout_prompts(args.prompts, args.prompt_len, cfg.vocab_size)
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
