"""Decode TPOT with CUDA graphs (issue 7): graph replay against the eager paged step, each
graph-compatible switch at its baseline, and MTP speculation with k = 1, 2, 3.

    python -m benchmarks.bench_decode_graphs --out benchmarks/results/decode-graphs-h200.json
    python -m benchmarks.bench_decode_graphs --dry-run --out /tmp/g.json   # CPU smoke (tiny model)
    python -m benchmarks.bench_decode_graphs --only loop --out ...  # host-work switches A/B

`--only loop` (issue 25): greedy decoding through `EngineCore.step`, so the host work between
replays counts, with features.greedy_in_graph / async_scheduling off, the first, both
(`run_loop`, records `decode_tpot_loop*` with `tokens_equal`).

Model: V4-Flash dimensions, layers 0,4,128,4 + the MTP layer, 256 routed experts, random bf16
weights, fp8 KV + MXFP4 indexer keys (as benchmarks/bench_engine.py). B requests are prefilled to
each context; the next decode step of all B is then timed again and again (it rewrites the
same cache rows): median wall time of `runner.execute` (forward, sampling, host work), so the
launch and host costs that graphs remove are in the number. Every variant runs the same step
on the same cache; tokens are compared with all_on (eager).

MTP: random weights accept no draft, and a spec step costs the same whatever is accepted
(verify 1 + k positions, MTP catch-up, k - 1 draft steps), so the step is timed here and the
TPOT is step time / (1 + expected accepted drafts) at the per-position acceptance measured
on the trained tiny model (`--acceptance`, cumulative rates as `SpecMetrics` reports them).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks import engine_setup as es
from benchmarks.attribution import attribute
from dsv4.runner.paged.decode_graphs import DecodeGraphs, GraphOptions
from dsv4.scheduler.request import Request

# switches whose baseline can be captured (t2r per builder and the boundary list are host work:
# graphs make them moot, they are measured eagerly in benchmarks/bench_engine.py)
GRAPH_VARIANTS = ("all_on", "shared_sparse_metadata_off", "skip_redundant_fill_off",
                  "skip_topk_off", "router_kernel_reference", "fused_mhc_off",
                  "glue_kernels_reference", "fused_shared_expert_on", "routing_stats_on",
                  "attention_all_heads_on", "indexer_variants_on")  # fmt: skip
OPT_IN = ("attention_all_heads_on", "indexer_variants_on")  # captured only when named


def _options(batches, contexts, capture: bool) -> GraphOptions:
    return GraphOptions(max_batch=max(batches), max_model_len=max(contexts), capture=capture,
                        batches=tuple(batches), contexts=tuple(contexts))  # fmt: skip


def _core(args, model, kernels, k: int, buckets):
    """A core with its decode passes captured; if capture fails, say why and go on eagerly
    (the eager numbers are still worth having from a device run)."""
    capture = model.embed.weight.device.type == "cuda"
    kw = dict(max_model_len=buckets[-1], max_seqs=max(args.batch_list), budget=args.budget,
              num_blocks=args.num_blocks, spec_tokens=k)  # fmt: skip
    try:
        return es.build_core(model, kernels, **kw,
                             graphs=_options(args.batch_list, buckets, capture))  # fmt: skip
    except Exception:
        traceback.print_exc()
        print("  CAPTURE FAILED: eager only", flush=True)
        return es.build_core(model, kernels, **kw)


def _bucket_contexts(contexts, k: int) -> list[int]:
    return sorted(c + 128 + k for c in contexts)  # a decode at position c + a few drafts


def _format_tags(args) -> str:
    """The served weight formats, in each record's shape (bf16: no tag)."""
    tags = ",experts=mxfp4" if args.expert_weights == "checkpoint" else ""
    return tags + (",linears=fp8" if args.linear_weights == "checkpoint" else "")


def _save(args) -> None:
    """Results so far (a device call may end before the benchmark does)."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(args.records, indent=1) + "\n")
    if args.attribution:
        path = args.out.with_name(args.out.stem + "-attribution.json")
        path.write_text(json.dumps(args.attribution, indent=1) + "\n")


def run_plain(args, model, kernels) -> None:
    dev = model.embed.weight.device
    batches, contexts = args.batch_list, args.context_list
    buckets = _bucket_contexts(contexts, 0)
    core = _core(args, model, kernels, 0, buckets)  # captures all_on
    runner = core.runner
    variants = [n for n in GRAPH_VARIANTS[1:] if n in args.variant_list]
    forwards = {name: es.variant(core, name) for name in (*variants, "all_off")}
    forwards["all_on"] = runner.forward.paged
    graphs = {"all_on": runner.forward.graphs} if runner.forward.graphs is not None else {}
    options = _options(batches, buckets, dev.type == "cuda")
    for name in variants:
        model.fuse_first_hc = es.fused_first(name)
        try:
            graphs[name] = DecodeGraphs(forwards[name], runner.cache, options, 0)
            graphs[name].capture()
        except Exception as exc:  # a capture failure is a result too: report and go on
            graphs.pop(name, None)
            print(f"  capture of {name} failed: {exc!r}", flush=True)
    model.fuse_first_hc = True
    gen = torch.Generator().manual_seed(0)
    records = args.records
    for ctx in contexts:
        for b in batches:
            rids = es.prefill_all(core, gen, model.cfg.vocab_size, b, ctx, f"c{ctx}b{b}")
            batch = core.scheduler.schedule()
            assert len(batch.decodes) == b and not batch.prefills
            runs = [
                ("eager:all_on", forwards["all_on"], None, True),
                ("eager:all_off", forwards["all_off"], None, False),
            ]
            runs += [(f"graph:{n}", forwards[n], graphs[n], es.fused_first(n)) for n in graphs]
            times, tokens = {}, {}
            for name, fwd, g, fused in runs:
                runner.forward.paged, runner.forward.graphs, model.fuse_first_hc = fwd, g, fused
                tokens[name] = runner.execute(batch).outputs
                times[name] = es.timed(lambda bt=batch: runner.execute(bt), dev, args.repeats, 3)
                if g is not None:
                    assert g.passes["target"].num_runs > 0, "the graph never served the step"
            floor = es.decode_floor_ms(model, b, ctx, runner.cache.layout.kv_entry_bytes)
            if ctx == contexts[0] and b in (min(batches), max(batches)):
                for name, g in (("graph", graphs.get("all_on")), ("eager", None)):
                    runner.forward.paged, runner.forward.graphs = forwards["all_on"], g
                    found = attribute(lambda bt=batch: runner.execute(bt), dev)
                    if found:
                        found.update(step=name, batch=b, context=ctx, floor_us=floor * 1e3)
                        args.attribution.append(found)
                        print(f"  attribution {name} B={b}: {found}", flush=True)
            runner.forward.paged, runner.forward.graphs, model.fuse_first_hc = (
                forwards["all_on"],
                None,
                True,
            )
            shape = f"B={b},ctx={ctx},layers={args.layers},E={model.cfg.n_routed_experts}"
            shape += _format_tags(args)
            on = times.get("graph:all_on", times["eager:all_on"])
            records.append(es.record("decode_tpot_graphs", shape, on, "eager paged step (all "
                                     "switches on)", times["eager:all_on"], 100 * floor / on))  # fmt: skip
            records += es.switch_records("decode_tpot_graphs_switch", shape, times, tokens,
                                         on_ms=on, token_ref="eager:all_on",
                                         skip=("graph:all_on", "eager:all_on"), floor_ms=floor)  # fmt: skip
            es.end_decode_step(core, batch, rids)
            _save(args)


def run_mtp(args, model, kernels) -> None:
    dev = model.embed.weight.device
    batches, contexts = args.batch_list, args.context_list[:1]
    rates = [float(r) for r in args.acceptance.split(",")]
    records = args.records
    for k in (1, 2, 3):
        core = _core(args, model, kernels, k, _bucket_contexts(contexts, k))
        runner = core.runner
        graphs = runner.forward.graphs
        gen = torch.Generator().manual_seed(k)
        expected = 1 + sum(rates[:k])
        for ctx in contexts:
            for b in batches:
                rids = es.prefill_all(core, gen, model.cfg.vocab_size, b, ctx, f"k{k}c{ctx}b{b}")
                batch = core.scheduler.schedule()
                assert len(batch.decodes) == b and all(
                    r.num_draft_tokens == k for r in batch.decodes
                )
                times = {}
                for name, g in (("graph", graphs), ("eager", None)):
                    runner.forward.graphs = runner.forward.spec.graphs = (
                        runner.forward.spec.mtp.graphs
                    ) = g
                    times[name] = es.timed(lambda bt=batch, rn=runner: rn.execute(bt), dev,
                                           args.repeats, 3)  # fmt: skip
                runner.forward.graphs = runner.forward.spec.graphs = (
                    runner.forward.spec.mtp.graphs
                ) = graphs
                floor = es.decode_floor_ms(model, b, ctx, runner.cache.layout.kv_entry_bytes)
                shape = f"B={b},ctx={ctx},k={k},tokens_per_step={expected:.2f}"
                shape += _format_tags(args)
                tpot = times["graph"] / expected
                # the floor of a one-token step over the spec step: the share of the card
                # a spec step uses (per token it would exceed 100%)
                print(
                    f"  k={k} B={b} ctx={ctx}: step graph {times['graph']:.3f} ms, eager "
                    f"{times['eager']:.3f} ms -> TPOT {tpot:.3f} ms",
                    flush=True,
                )
                rec = es.record("decode_tpot_mtp", shape, tpot, "spec step eager / tokens",
                                times["eager"] / expected, 100 * floor / times["graph"])  # fmt: skip
                rec["step_time_us"] = round(times["graph"] * 1e3, 1)
                records.append(rec)
                es.end_decode_step(core, batch, rids)
                _save(args)
        del core, graphs, runner
        gc.collect()  # graphs and their memory pools go with the core
        if dev.type == "cuda":
            torch.cuda.empty_cache()


# the decode loop's host-work switches (issue 25): (greedy_in_graph, async_scheduling)
LOOP_VARIANTS = {"sampler": (False, False), "greedy_in_graph": (True, False),
                 "async_scheduling": (True, True)}  # fmt: skip


def run_loop(args, model, kernels) -> None:
    """Served TPOT of greedy decoding through `EngineCore.step` (schedule, launch, sync,
    update: the host work a replay-only timing leaves out), per host-work switch, on ONE
    core whose graphs take the argmax: the switches flip between runs of the same requests."""
    dev, steps = model.embed.weight.device, args.loop_steps
    buckets = [*_bucket_contexts(args.context_list, 0), max(args.context_list) + steps + 256]
    options = _options(args.batch_list, sorted(set(buckets)), dev.type == "cuda")
    kw = dict(max_model_len=options.max_model_len, max_seqs=max(args.batch_list),
              budget=args.budget, num_blocks=args.num_blocks)  # fmt: skip
    core = es.build_core(model, kernels, **kw, graphs=replace(options, greedy_argmax=True))
    gen = torch.Generator().manual_seed(7)
    for ctx in args.context_list:
        for b in args.batch_list:
            times, tokens = {}, {}
            prompts = [torch.randint(2, model.cfg.vocab_size, (ctx,), generator=gen)
                       for _ in range(b)]  # fmt: skip
            for name, (greedy, ahead) in LOOP_VARIANTS.items():
                core.runner.forward.greedy_in_graph, core.async_scheduling = greedy, ahead
                for i, p in enumerate(prompts):
                    core.add_request(Request(f"{name}-{i}", tuple(p.tolist()),
                                             max_new_tokens=steps + 1, eos_token_id=None))  # fmt: skip
                out: dict[str, list[int]] = {}
                while len(out) < b:  # prefill: every request has its first token
                    for o in core.step():
                        out.setdefault(o.request_id.split("-")[1], []).extend(o.new_token_ids)
                es.sync(dev)
                started, ahead_before = time.perf_counter(), core.num_steps_ahead
                while core.has_work():
                    for o in core.step():
                        out[o.request_id.split("-")[1]].extend(o.new_token_ids)
                es.sync(dev)
                times[name] = (time.perf_counter() - started) * 1e3 / steps
                tokens[name] = out
                print(f"  loop B={b} ctx={ctx} {name}: TPOT {times[name]:.3f} ms "
                      f"({core.num_steps_ahead - ahead_before} steps ahead)", flush=True)  # fmt: skip
            shape = f"B={b},ctx={ctx},steps={steps}" + _format_tags(args)
            args.records.append(es.record("decode_tpot_loop", shape, times["async_scheduling"],
                                          "sampler, no async scheduling", times["sampler"], 0.0))  # fmt: skip
            for name in ("greedy_in_graph", "async_scheduling"):
                rec = es.record(f"decode_tpot_loop_{name}", shape, times[name], "sampler",
                                times["sampler"], 0.0)  # fmt: skip
                rec["tokens_equal"] = tokens[name] == tokens["sampler"]
                args.records.append(rec)
            _save(args)
    assert not core.find_leaks(), core.find_leaks()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, references")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", default="0,4,128,4")
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--contexts", default="4096,1024")
    parser.add_argument("--budget", type=int, default=16384)
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument(
        "--acceptance",
        default="0.837,0.672,0.573",
        help="cumulative acceptance per draft position: the trained tiny model, greedy "
        "(benchmarks/results/mtp-acceptance-trained-tiny.json)",
    )
    parser.add_argument("--only", choices=("plain", "mtp", "loop"), default=None)
    parser.add_argument("--loop-steps", type=int, default=64,
                        help="decode steps per run of the host-work A/B (--only loop)")  # fmt: skip
    parser.add_argument("--expert-weights", choices=("bf16", "checkpoint"), default="bf16",
                        help="routed experts in bf16 or MXFP4 as a checkpoint stores them")  # fmt: skip
    parser.add_argument("--linear-weights", choices=("bf16", "checkpoint"), default="bf16",
                        help="attention/shared-expert/MTP linears in bf16 or FP8 (128x128 "
                        "block scales) as a checkpoint stores them")  # fmt: skip
    parser.add_argument(
        "--variants",
        default=",".join(v for v in GRAPH_VARIANTS[1:] if v not in OPT_IN),
        help="switch variants captured beside all_on (comma list; '' = none)",
    )
    args = parser.parse_args(argv)
    if args.dry_run:
        args.batches, args.contexts, args.budget, args.num_blocks = "1,3", "300,40", 512, 256
        args.repeats, args.loop_steps = 2, 6
    elif not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --dry-run)")
    args.records, args.attribution = [], []
    args.variant_list = [v for v in args.variants.split(",") if v]
    args.batch_list = [int(b) for b in args.batches.split(",")]
    args.context_list = [int(c) for c in args.contexts.split(",")]
    formats = dict(expert_weights=args.expert_weights, linear_weights=args.linear_weights)
    cfg = es.model_config(args.layers, args.experts, args.dry_run, mtp=True, **formats)
    model, kernels = es.build_model(cfg, args.dry_run, **formats)
    if args.only in (None, "plain"):
        run_plain(args, model, kernels)
        gc.collect()  # the plain core and its graphs
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.only in (None, "mtp"):
        run_mtp(args, model, kernels)
    if args.only in (None, "loop"):
        gc.collect()
        run_loop(args, model, kernels)
    _save(args)
    print(f"wrote {len(args.records)} records to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
