"""Engine-level decode TPOT and prefill TTFT on one GPU: the paged forward with each speed
switch at its baseline, against the reference forward, on the same cache and inputs.

    python -m benchmarks.bench_engine decode --out benchmarks/results/decode-h200.json
    python -m benchmarks.bench_engine prefill --out benchmarks/results/prefill-h200.json
    python -m benchmarks.bench_engine decode --dry-run --out /tmp/d.json  # CPU smoke (tiny model)

Decode: V4-Flash dimensions, layers `--layers` (default 0,4,128,4), 256 routed experts, random
bf16 weights, fp8 KV + MXFP4 indexer keys. B requests are prefilled to `--contexts` tokens; the
next decode step of all B is then run again and again (it rewrites the same cache rows, so every
repeat and every variant sees the same state): TPOT = median wall time of one engine step
(forward + greedy sampling), host included. Variants share weights and cache; each record
compares a switch's baseline with all switches on, and all on with the reference forward.
Token agreement with all_on is printed per variant (the reference forward attends fresh rows
unquantised, so it may differ by fp8 noise).

Prefill: `--layers` default 0,4,128,4,128,4,128,4 (four C4 layers, so IndexCache frequency 2 is
FSFS and 4 is FSSS), `--experts` 64 (the per-token MoE work of Flash: top-6), a lone prompt of
each length in 16K-token chunks: TTFT = wall time from admission to the first token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks import engine_setup as es
from dsv4.config.index_pattern import IndexPattern
from dsv4.runner.reference.forward import ReferenceForward
from dsv4.scheduler.request import Request


def _prompt(gen, vocab: int, n: int) -> tuple[int, ...]:
    return tuple(torch.randint(2, vocab, (n,), generator=gen).tolist())


def _drain(core, rids) -> None:
    for rid in rids:
        core.abort(rid)
    while core.has_work():
        core.step()


def run_decode(args) -> list[dict]:
    cfg = es.model_config(args.layers, args.experts, args.dry_run)
    model, kernels = es.build_model(cfg, args.dry_run)
    dev = model.embed.weight.device
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    core = es.build_core(model, kernels, max_model_len=max(contexts) + 128, max_seqs=max(batches),
                         budget=args.budget, num_blocks=args.num_blocks)  # fmt: skip
    variants = {name: es.variant(core, name) for name in es.VARIANTS}
    runner = core.runner
    gen = torch.Generator().manual_seed(0)
    records = []
    for ctx in contexts:
        for b in batches:
            rids = es.prefill_all(core, gen, cfg.vocab_size, b, ctx, f"c{ctx}b{b}")
            batch = core.scheduler.schedule()
            assert len(batch.decodes) == b and not batch.prefills
            times, tokens = {}, {}
            for name, fwd in variants.items():
                runner.forward.paged, model.fuse_first_hc = fwd, es.fused_first(name)
                tokens[name] = runner.execute(batch).outputs
                times[name] = es.timed(lambda b=batch: runner.execute(b), dev, args.repeats, 3)
            runner.forward.paged, model.fuse_first_hc = variants["all_on"], True
            ref_reps = max(3, args.repeats // 10)
            paged_forward = runner.forward
            runner.forward = ReferenceForward(model, runner.cache, runner.sampler)
            tokens["reference_forward"] = runner.execute(batch).outputs
            times["reference_forward"] = es.timed(
                lambda b=batch: runner.execute(b), dev, ref_reps, 1
            )
            runner.forward = paged_forward
            floor = es.decode_floor_ms(model, b, ctx, core.runner.cache.layout.kv_entry_bytes)
            shape = f"B={b},ctx={ctx},layers={args.layers},E={cfg.n_routed_experts}"
            on = times["all_on"]
            records.append(es.record("decode_tpot", shape, on, "reference forward (per-request "
                                     "states, torch attention)", times["reference_forward"],
                                     100 * floor / on))  # fmt: skip
            records += es.switch_records("decode_tpot_switch", shape, times, tokens, on_ms=on,
                                         token_ref="all_on", skip=("all_on", "reference_forward"),
                                         floor_ms=floor)  # fmt: skip
            es.end_decode_step(core, batch, rids)
    return records


PREFILL_VARIANTS = ("all_on", "shared_sparse_metadata_off", "index_cache_f2", "index_cache_f4",
                    "all_off")  # fmt: skip


def _ttft(core, gen, vocab, length, rid, dev) -> float:
    es.sync(dev)
    import time

    start = time.perf_counter()
    core.add_request(Request(rid, _prompt(gen, vocab, length), max_new_tokens=1,
                             eos_token_id=None))  # fmt: skip
    done = False
    while not done:
        done = any(o.request_id == rid and o.new_token_ids for o in core.step())
    es.sync(dev)
    elapsed = (time.perf_counter() - start) * 1e3
    _drain(core, [rid])
    return elapsed


def run_prefill(args) -> list[dict]:
    cfg = es.model_config(args.layers, args.experts, args.dry_run)
    model, kernels = es.build_model(cfg, args.dry_run)
    dev = model.embed.weight.device
    gen = torch.Generator().manual_seed(1)
    records = []
    for length in [int(n) for n in args.lengths.split(",")]:
        blocks = 2 * (length // 256 + 32)
        times = {}
        for name in PREFILL_VARIANTS:
            freq = {"index_cache_f2": 2, "index_cache_f4": 4}.get(name, 1)
            pattern = IndexPattern.from_freq(cfg, freq)
            model.set_index_pattern(pattern)
            core = es.build_core(model, kernels, max_model_len=length + 64, max_seqs=4,
                                 budget=args.budget, num_blocks=blocks,
                                 index_pattern=pattern.roles)  # fmt: skip
            switch = name if name in es.VARIANTS else "all_on"
            core.runner.forward.paged = es.variant(core, switch)
            model.fuse_first_hc = es.fused_first(switch)
            if not times:  # one warm-up per length: autotuning and JIT stay out of the numbers
                _ttft(core, gen, cfg.vocab_size, length, "warm", dev)
            runs = [_ttft(core, gen, cfg.vocab_size, length, f"{name}-{i}", dev)
                    for i in range(args.repeats)]  # fmt: skip
            times[name] = min(runs)
            model.fuse_first_hc = True
            print(f"  prompt {length:7d} {name:28s} {times[name]:10.1f} ms", flush=True)
            del core
        model.set_index_pattern(IndexPattern.all_full(cfg))
        shape = f"prompt={length},chunk={args.budget},layers={args.layers},E={cfg.n_routed_experts}"
        on = times["all_on"]
        pct = 100 * es.prefill_flops(model, length) / (on * 1e-3) / es.PEAK_FLOPS
        for name, t in times.items():
            if name == "all_on":
                continue
            if name.startswith("index_cache"):
                records.append(es.record("prefill_ttft", f"{shape},switch={name}", t,
                                         "index cache off (all Full)", on, pct))  # fmt: skip
            else:
                records.append(es.record("prefill_ttft", f"{shape},switch={name}", on,
                                         f"{name} (baseline)", t, pct))  # fmt: skip
    return records


def run_planner(args) -> list[dict]:
    """One step that prefills 8 prompts of 2048 tokens: the area chunk planner (#45061) against
    the fixed one (group of 4, workspaces sized for max_model_len = 128K)."""
    cfg = es.model_config(args.layers, args.experts, args.dry_run)
    model, kernels = es.build_model(cfg, args.dry_run)
    dev = model.embed.weight.device
    n, length = (8, 2048) if not args.dry_run else (4, 60)
    times = {}
    for plan in ("area", "fixed"):
        core = es.build_core(model, kernels, max_model_len=131072, max_seqs=n,
                             budget=n * length, num_blocks=4096, plan=plan)  # fmt: skip
        gen = torch.Generator().manual_seed(3)
        runs = []
        for rep in range(args.repeats + 1):
            es.sync(dev)
            import time

            start = time.perf_counter()
            rids = es.prefill_all(core, gen, cfg.vocab_size, n, length, f"{plan}{rep}")
            es.sync(dev)
            runs.append((time.perf_counter() - start) * 1e3)
            _drain(core, rids)
        times[plan] = min(runs[1:])  # the first run warms up
        print(f"  plan {plan:6s} {times[plan]:9.1f} ms", flush=True)
    shape = f"{n}x{length} prompts,one step,max_model_len=131072,layers={args.layers}"
    pct = 100 * n * es.prefill_flops(model, length) / (times["area"] * 1e-3) / es.PEAK_FLOPS
    return [es.record("prefill_batch_step", shape, times["area"], "fixed chunk plan (#45061 "
                      "baseline)", times["fixed"], pct)]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("decode", "prefill", "planner"))
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, references")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", default="")
    parser.add_argument("--experts", type=int, default=0)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--contexts", default="4096,1024")
    parser.add_argument("--lengths", default="8192,32768,131072")
    parser.add_argument("--budget", type=int, default=16384, help="tokens per engine step")
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=0)
    args = parser.parse_args(argv)
    decode = args.mode == "decode"
    args.layers = args.layers or ("0,4,128,4" if decode else "0,4,128,4,128,4,128,4")
    args.experts = args.experts or (256 if decode else 64)
    args.repeats = args.repeats or (30 if decode else 2)
    if args.dry_run:
        args.batches, args.contexts, args.lengths = "1,3", "40,300", "300,700"
        args.budget, args.num_blocks, args.repeats = 256, 256, 2
    elif not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --dry-run)")
    run = {"decode": run_decode, "prefill": run_prefill, "planner": run_planner}[args.mode]
    records = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {len(records)} records to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
