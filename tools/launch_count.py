"""Where one fresh prefill step's device launches are, per layer and component, without a GPU.

    python tools/launch_count.py --prompt-len 1024 --formats bf16,checkpoint --out /tmp/l.json

The step: benchmarks/prefill_attribution.py's (`runner.execute` of a fresh prompt on the prefill
worker `build_worker_runtime` builds, Triton kernels, fp8 KV, MXFP4 indexer keys), run twice on
the CPU (the second counted) on a tiny model with the slice's layer kinds (`--layers`) and the
V4-Flash values that steer control flow (`model_config`). Counted as on CUDA by
tools/launch_counter.py's modes (which calls launch, copy or sync, what lives on the device, the
layer and component of each launch), and Triton launches (`_launch_hook`); `MULTI_KERNEL` ops
launch more than their one count. `torch.cuda` reports an H100, so wrappers take their CUDA
branches. Registered kernel ops run dry (`_dry_op`); other launches run on the interpreter.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # launches outside a registered op run on it

import argparse
import contextlib
import dataclasses
import functools
import json
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from triton.runtime.autotuner import Autotuner
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from dsv4.commands.service_args import service_config
from dsv4.config.model import tiny_config
from dsv4.model.tiny import write_model_spec
from dsv4.runner.paged.decode_graphs import GraphOptions
from dsv4.scheduler.request import Request
from dsv4.worker import build as worker_build
from kernels import registry

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: launch_counter, launch_rules
from launch_counter import LaunchCounter, Launches, Residency
from launch_rules import ATTENTION_SIDE, MULTI_KERNEL, TOKEN_PARALLEL

H100 = SimpleNamespace(multi_processor_count=132, major=9, minor=0)  # get_device_properties


def _dry_op(c: LaunchCounter, spec):
    """`spec`'s Triton wrapper run dry, its reference computing the values (module doc)."""
    triton_fn, ref_fn, name = spec.triton_fn, spec.ref_fn, spec.name

    @functools.wraps(triton_fn)
    def op(*args, **kwargs):
        if not c.active:  # outside the step: the kernel; inside a reference: the reference
            return (ref_fn if c.counting else triton_fn)(*args, **kwargs)
        c.ops.append(name)
        c.dry += 1
        try:
            out = triton_fn(*args, **kwargs)
        finally:
            c.dry -= 1
            c.ops.pop()
        if c.dry:  # inside another dry op: that op's reference computes the values
            return out
        with c.quiet():
            return _fill(c, name, out, ref_fn(*args, **kwargs))

    return op


def _fill(c: LaunchCounter, name: str, out, ref):
    """The wrapper's outputs (CUDA dtypes, layouts) holding the reference's values."""
    outs, spec = tree_flatten(out)
    refs = tree_flatten(ref)[0]
    if len(outs) != len(refs) or any(isinstance(o, torch.Tensor) and not (
            isinstance(r, torch.Tensor) and o.shape == r.shape) for o, r in zip(outs, refs)):  # fmt: skip
        c.mismatches[name] += 1
        return ref
    return tree_unflatten([o.copy_(r) if isinstance(o, torch.Tensor) else r
                           for o, r in zip(outs, refs)], spec)  # fmt: skip


def _launch_hook(c: LaunchCounter, original):
    def run(self, *args, **kwargs):
        if not c.active or kwargs.get("warmup"):
            return original(self, *args, **kwargs)
        c.record("triton", getattr(self.fn, "__name__", str(self.fn)))
        if c.dry:
            return None
        with c.quiet():  # outside every registered op: on the interpreter
            return original(self, *args, **kwargs)

    return run


@contextlib.contextmanager
def patched(c: LaunchCounter, decode_batch: int = 0):
    """Registered ops dry (in the registry and every module that imported them), launches
    hooked, autotuning untimed (its first config), an H100 behind torch.cuda; `decode_batch`:
    the worker's decode graphs as static passes of that batch (`_static_passes`); undone on
    exit."""
    with contextlib.ExitStack() as undo:

        def swap(owner, attr, value):
            undo.callback(setattr, owner, attr, getattr(owner, attr))
            setattr(owner, attr, value)

        ours = [m for n, m in sys.modules.items() if n.split(".")[0] in ("dsv4", "kernels")]
        for spec in registry.all_ops():
            wrapper = _dry_op(c, spec)
            undo.callback(registry._OPS.__setitem__, spec.name, spec)
            registry._OPS[spec.name] = type(spec)(spec.name, wrapper, spec.ref_fn, spec.family,
                                                  spec.baseline_fn)  # fmt: skip
            for mod in ours:
                for attr, value in list(vars(mod).items()):
                    if value is spec.triton_fn:
                        swap(mod, attr, wrapper)
        for cls in (InterpretedFunction, JITFunction):
            swap(cls, "run", _launch_hook(c, cls.run))
        swap(Autotuner, "_bench", lambda self, *a, config, **k: [0.0, 0.0, 0.0])
        swap(torch.cuda, "get_device_properties", lambda *a, **k: H100)
        swap(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
        swap(torch.cuda, "current_device", lambda: 0)
        swap(torch.cuda, "is_current_stream_capturing", lambda: False)
        if decode_batch:
            swap(worker_build, "paged_options", _static_passes(worker_build.paged_options,
                                                               decode_batch))  # fmt: skip
        yield


def _static_passes(paged_options, batch: int):
    """The worker's `paged_options` with its decode graphs (off on a CPU device) as one batch
    bucket's static passes run eagerly: the code a graph of that bucket captures."""

    def options(config):
        return dataclasses.replace(paged_options(config), graphs=GraphOptions(
            max_batch=batch, max_model_len=config.model.max_model_len, capture=False,
            greedy_argmax=config.features.greedy_in_graph))  # fmt: skip

    return options


FORMATS = ("bf16", "checkpoint")  # checkpoint: MXFP4 experts (halves128) + FP8 linears


def model_config(ratios: tuple[int, ...], experts: int, fmt: str):
    """The tiny model with `ratios` and V4-Flash's window 128 (chunk tables), top-k 512 (does the
    indexer run), 6 experts a token (the MoE path), 128-column expert blocks (halves128)."""
    over = {"num_hidden_layers": len(ratios), "compress_ratios": ratios, "sliding_window": 128,
            "index_topk": 512, "n_routed_experts": experts, "num_experts_per_tok": 6,
            "moe_intermediate_size": 128, "num_nextn_predict_layers": 0,
            "max_position_embeddings": 1 << 20}  # fmt: skip
    if fmt == "checkpoint":
        over.update(expert_dtype="fp4", linear_dtype="fp8")
    return tiny_config().with_overrides(**over)


def count_step(fmt: str, prompt_len: int, ratios: tuple[int, ...], experts: int,
               decode_batch: int = 0) -> dict:  # fmt: skip
    """The record of one fresh `prompt_len`-token prefill step, or with `decode_batch` B of one
    decode step of B requests after their prefill: the static pass a decode graph captures
    (`GraphOptions(capture=False)`: run eagerly) with its input upload and in-graph argmax."""
    cfg, b = model_config(ratios, experts, fmt), decode_batch
    c = LaunchCounter()
    with tempfile.TemporaryDirectory(prefix="launches-") as work, patched(c, b):
        spec = write_model_spec(Path(work) / fmt, cfg)
        flags = ("--model", f"random:{spec}", "--device", "cpu", "--dtype", "bf16",
                 "--kernels", "triton", "--kv-dtype", "fp8", "--indexer-key-dtype", "mxfp4",
                 "--max-model-len", str(max(prompt_len + 64, 512)), "--num-blocks", str(16 * max(b, 4)),
                 "--max-num-batched-tokens", str(max(prompt_len * max(b, 1), 512)),
                 "--role", "colocated" if b else "prefill", "--expert-weights", fmt,
                 "--linear-weights", fmt, "--forward", "paged")  # fmt: skip
        c.counting = bool(b)  # a decode step's set-up (the passes' warm-up, the prefill) runs
        with c.quiet():  # the references, not the interpreter
            runtime = worker_build.build_worker_runtime(service_config(flags, {}),
                                                        with_transport=False)  # fmt: skip
            core = runtime.engine.core
            gen = torch.Generator().manual_seed(prompt_len)
            for i in range(max(b, 1)):
                prompt = torch.randint(2, cfg.vocab_size, (prompt_len,), generator=gen).tolist()
                core.add_request(Request(f"launches-{i}", tuple(prompt), eos_token_id=None,
                                         max_new_tokens=3 if b else 1))  # fmt: skip
            if b:
                core.step(ahead=False)
        for p in getattr(core.runner.forward.graphs, "passes", {}).values():
            c.mark(p.inputs.host, False)  # the static inputs' pinned host buffer
        model = core.runner.forward.paged.model
        c.names = {id(m): n for n, m in model.named_modules()}
        c.layers = {id(b): str(i) for i, b in enumerate(model.layers)}
        batch = core.scheduler.schedule()
        assert [r.num_tokens for r in batch.requests if r.is_prefill] == ([] if b else [prompt_len])
        assert len(batch.requests) == max(b, 1)
        # a decode step: the forward, whose greedy tokens stay on the device (no cuda.Event)
        step = core.runner.forward.run if b else core.runner.execute
        with Residency(c), Launches(c), torch.no_grad():
            c.counting = True
            try:
                step(batch)  # warm: lazily built tables, autotuner choices
                c.events.clear(), c.syncs.clear(), c.mismatches.clear()
                step(batch)  # rewrites the same KV rows, as the benchmark does
            finally:
                c.counting = False
    return summarize(c, fmt, prompt_len, ratios, experts) | ({"decode_batch": b} if b else {})


def summarize(c: LaunchCounter, fmt: str, prompt_len: int, ratios, experts: int) -> dict:
    """launches = aten kernels + Triton (memcpys apart); components: {name: {region: n}}."""
    launches = [e for e in c.events if e[0] != "memcpy"]
    regions = sorted({e[2] for e in launches}, key=lambda r: (r == "step", len(r), r))
    table: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(regions, 0))
    for _, _, region, component, _ in launches:
        table[component][region] += 1
    total = {k: sum(v.values()) for k, v in table.items()}
    group = lambda names: sum(total.get(n, 0) for n in names)  # noqa: E731
    return {
        "name": "launch_count", "format": fmt, "prompt_len": prompt_len,
        "layers": ",".join(map(str, ratios)), "experts": experts, "launches": len(launches),
        "kernels": sum(e[0] == "kernel" for e in launches),
        "triton": sum(e[0] == "triton" for e in launches),
        "memcpy": dict(Counter(e[1] for e in c.events if e[0] == "memcpy")),
        "host_syncs": len(c.syncs), "sync_calls": dict(Counter(s[0] for s in c.syncs)),
        "sync_sites": dict(Counter(f"{s[0]} @ {s[3]}" for s in c.syncs)), "regions": regions,
        "components": {k: dict(table[k]) for k in sorted(table, key=lambda k: -total[k])},
        "token_parallel": group(TOKEN_PARALLEL), "attention_side": group(ATTENTION_SIDE),
        "rest": len(launches) - group(TOKEN_PARALLEL) - group(ATTENTION_SIDE),
        "top_ops": Counter(e[1] for e in launches).most_common(30),
        "multi_kernel_ops": dict(Counter(e[1] for e in launches if e[1] in MULTI_KERNEL)),
        "top_sites": Counter(f"{e[4]} {e[1]}" for e in launches).most_common(40),
        "value_mismatches": dict(c.mismatches),
    }  # fmt: skip


def report(rec: dict, top: int = 15) -> str:
    regions = rec["regions"]
    step = (f"decode batch {rec['decode_batch']} after {rec['prompt_len']}-token prompts"
            if rec.get("decode_batch") else f"{rec['prompt_len']} tokens")  # fmt: skip
    lines = [f"{rec['format']}, {step}, layers {rec['layers']}: "
             f"{rec['launches']} launches ({rec['kernels']} aten kernels, {rec['triton']} "
             f"Triton), memcpys {rec['memcpy']}, host syncs {rec['host_syncs']}",
             f"{'component':18s}" + "".join(f"{r:>8s}" for r in regions) + f"{'total':>8s}"]  # fmt: skip
    for comp, row in rec["components"].items():
        cells = "".join(f"{row.get(r, 0):8d}" for r in regions)
        lines.append(f"{comp:18s}{cells}{sum(row.values()):8d}")
    lines += [f"token-parallel {rec['token_parallel']}, attention side {rec['attention_side']}, "
              f"step-level/other {rec['rest']}",
              f"multi-kernel ops (one count each): {rec['multi_kernel_ops']}", "host syncs:",
              *(f"  {n:5d}  {s}" for s, n in rec["sync_sites"].items()), "top ops:",
              *(f"  {n:5d}  {op}" for op, n in rec["top_ops"][:top]), "top sources:",
              *(f"  {n:5d}  {site}" for site, n in rec["top_sites"][:top])]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--layers", default="0,4,128,4", help="compress ratio of each layer")
    ap.add_argument("--experts", type=int, default=256, help="routed experts (V4-Flash: 256)")
    ap.add_argument("--decode-batch", type=int, default=0,
                    help="count one decode step of this batch (its graph's code) after the "
                    "prompts' prefill; 0: the prefill step")  # fmt: skip
    ap.add_argument("--formats", default="bf16,checkpoint", help=f"comma list of {FORMATS}")
    ap.add_argument("--out", type=Path, help="write the records as JSON")
    args = ap.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    if unknown := set(formats) - set(FORMATS):
        ap.error(f"unknown formats {sorted(unknown)}: pick from {FORMATS}")
    ratios = tuple(int(r) for r in args.layers.split(","))
    records = [count_step(fmt, args.prompt_len, ratios, args.experts, args.decode_batch)
               for fmt in formats]  # fmt: skip
    print("\n\n".join(map(report, records)))
    if args.out:
        args.out.write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
