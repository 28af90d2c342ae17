"""Timing of served expert offload (`benchmarks/offload_serve_check.py` writes these records).

Each run (`RUNS`: the paged forward with CUDA graphs and its expert pool, without and with
`features.expert_prefetch` and / or `features.expert_staging`; reference: the offload stores) serves
the same random model at the same device budget, once per routing ("uniform": the random
gates, the experts kept on the device in index order; "zipf1": popularity ~ 1/rank,
`dsv4.model.skew`, with the most popular experts kept on the device: a residency file of the
expected routing counts, what `dsv4 plan --routing-stats` writes once the worker's counts
have converged; record field `residency`). The engine core is driven directly,
one step per call, as a worker serves (the token read each step is the served sync).

`full_depth_tpot` (per decode batch), `full_depth_ttft` (one `--ttft-prompt` prompt) and
`full_depth_prefill` (one `--prefill-prompt` prompt, when given):
- time_us: a decode step (TPOT) or the prompt to its first token (TTFT, prefill), wall clock;
- tok_s (prefill only): prompt tokens per second of time_us;
- hit_rate, bytes_fetched: the offload's counters over the timed steps (bytes per step,
  prefetched bytes included; `prefetches`: experts copied ahead of their layer per step);
- copy_floor_us: bytes_fetched / 55 GB/s (the pinned host -> device floor of the H100/H200);
- compute_us: the same shape served all-resident (paged forward), where the plan fits the
  device without offload; copy_wait_us = time_us - compute_us (`compute_source`
  "all_resident"). Where all-resident does not fit (the 43-layer model on one card), the
  step's own split: copy_wait_us = copy_wait_measured_us per token, compute_us = time_us -
  copy_wait_us (`compute_source` "step_minus_wait"; null for the untimed reference stores);
- copy_wait_measured_us: the time the compute stream waited for expert copies, per timed step,
  as the pool's device clock stamps measured it (`PoolStats.copy_wait_ns`: joining prefetches
  and copying misses; on CPU the copies' own time); null for the reference forward, whose
  stores are not timed. copy_wait_us is what offload cost in all; this is the part of it spent
  waiting for copies (the rest: resolving slots, the pool's longer expert GEMM inputs);
- baseline_time_us: the reference forward's offload on the same inputs (null when skipped or
  for the reference's own records); speedup = baseline_time_us / time_us;
- graph_max_batch: the captured decode batch the worker chose (its pool's slots fit the plan);
  a larger batch's steps ran eagerly (cuda_graphs says only that graphs were on).

MTP (`--mtp-k K`, K > 0): the worker speculates with its MTP layer (`speculative.method=mtp`),
so a step verifies 1 + K tokens a sequence and runs the MTP layer's drafts, each through the
offloaded experts. Random weights accept no draft and a spec step costs the same whatever is
accepted, so `full_depth_tpot`'s time_us is the measured step (`step_time_us`) over
`tokens_per_step` = 1 + the expected accepted drafts at the per-position acceptance of the
trained tiny model (`--acceptance`, as benchmarks/bench_decode_graphs.py does).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from dsv4.config import load_config
from dsv4.config.model import ModelConfig
from dsv4.model.skew import zipf_expected_counts, zipf_layer_ranks
from dsv4.plan import PlanDoesNotFit
from dsv4.plan.residency import Residency, write_residency
from dsv4.types import GenerateRequest, SamplingParams
from dsv4.worker.build import build_worker_runtime, planned_model_config
from dsv4.worker.fit import startup_plan
from dsv4.worker.offload import num_moe_layers

COPY_GB_PER_S = 55.0


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _add(runtime, name: str, prompts: list[list[int]], new_tokens: int) -> None:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        request = GenerateRequest(f"{name}-{i}", tuple(prompt), greedy)
        runtime.engine.core.add_request(runtime.engine_request(request))


def _prompts(vocab: int, batch: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch * 1000 + length)
    return torch.randint(2, vocab, (batch, length), generator=gen).tolist()


def _drain(core) -> None:
    while core.has_work():
        core.step()
    core.scheduler.check_no_leaks()


def _traffic(runtime, steps: int) -> dict:
    if runtime.offload is None:
        return dict(hit_rate=None, bytes_fetched=0, prefetches=0, copy_wait_measured_us=None)
    stats, per_step = runtime.offload.stats(), max(steps, 1)
    wait_ns = getattr(stats, "copy_wait_ns", None)  # the paged pool's only
    return dict(hit_rate=stats.hit_rate, bytes_fetched=stats.bytes_fetched // per_step,
                prefetches=stats.prefetches / per_step,
                copy_wait_measured_us=None if wait_ns is None else wait_ns / per_step / 1e3)  # fmt: skip


def tpot(runtime, batch: int, prompt_len: int, steps: int, tokens_per_step: float = 1.0) -> dict:
    """A decode step of `batch` requests, averaged over `steps` steps after every request's
    prefill (the offload's counters reset first); time_us = step / `tokens_per_step` (MTP:
    the expected tokens a spec step yields, see the module doc)."""
    core = runtime.engine.core
    drafts = runtime.config.speculative.num_speculative_tokens
    spec = runtime.config.speculative.method == "mtp"
    # room for every draft to be accepted: no request ends inside the timed steps
    new_tokens = (steps + 4) * (1 + (drafts if spec else 0))
    _add(runtime, f"tpot{batch}", _prompts(runtime.model_config.vocab_size, batch, prompt_len),
         new_tokens)  # fmt: skip
    decoding: set[str] = set()
    while len(decoding) < batch:
        decoding.update(o.request_id for o in core.step() if o.new_token_ids)
    if runtime.offload is not None:
        runtime.offload.reset_stats()
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    _sync()
    step_us = (time.perf_counter() - start) / steps * 1e6
    out = dict(time_us=step_us / tokens_per_step, **_traffic(runtime, steps))
    if spec:
        out.update(step_time_us=step_us, tokens_per_step=tokens_per_step)
    _drain(core)
    return out


def ttft(runtime, prompt_len: int) -> dict:
    """One prompt of `prompt_len` tokens to its first token."""
    core = runtime.engine.core
    _add(runtime, "ttft", _prompts(runtime.model_config.vocab_size, 1, prompt_len), 1)
    if runtime.offload is not None:
        runtime.offload.reset_stats()
    _sync()
    start = time.perf_counter()
    while not any(o.new_token_ids for o in core.step()):
        pass
    _sync()
    out = dict(time_us=(time.perf_counter() - start) * 1e6, **_traffic(runtime, 1))
    _drain(core)
    return out


def resident_fits(values: dict) -> bool:
    """The plan fits the device without offload (a CPU device always does)."""
    config = load_config(values)
    if not config.model.device.startswith("cuda"):
        return True
    total = torch.cuda.get_device_properties(torch.device(config.model.device)).total_memory
    try:
        return startup_plan(config, planned_model_config(config), total).verdict == "fits"
    except PlanDoesNotFit:
        return False


def routing_values(routing: str, values: dict, directory: Path) -> dict:
    """The worker settings of `routing`: zipf1 also keeps each layer's most popular experts on
    the device (a residency file of the expected counts, written under `directory`)."""
    out = {"model.random_routing": routing}
    if routing != "zipf1":
        return out
    config = load_config(values)
    cfg = ModelConfig.from_file(config.model.model_dir)
    ranks = zipf_layer_ranks(num_moe_layers(cfg), cfg.n_routed_experts, config.model.seed)
    path = directory / "zipf1-residency.json"
    write_residency(Residency.from_counts([zipf_expected_counts(r) for r in ranks]), path)
    return {**out, "model.expert_residency": str(path)}


def measure(values: dict, args) -> dict[tuple[str, int], dict]:
    """{(name, batch): timing} of one runtime built from `values`."""
    from benchmarks.offload_serve_check import release

    runtime = build_worker_runtime(load_config(values), with_transport=False)
    per_step = tokens_per_spec_step(args)
    out = {("full_depth_tpot", b): tpot(runtime, b, args.prompt_len, args.steps, per_step)
           for b in (int(b) for b in args.batches.split(","))}  # fmt: skip
    if args.ttft_prompt:  # 0: no TTFT record (a call that times decode batches only)
        out[("full_depth_ttft", 1)] = ttft(runtime, args.ttft_prompt)
    if args.prefill_prompt:
        first = ttft(runtime, args.prefill_prompt)
        out[("full_depth_prefill", 1)] = {**first,
                                          "tok_s": args.prefill_prompt / first["time_us"] * 1e6}  # fmt: skip
    features = runtime.config.features
    on_cuda = runtime.config.model.device.startswith("cuda")
    info = dict(forward=features.forward, expert_prefetch=features.expert_prefetch,
                expert_staging=features.expert_staging,
                residency="popularity" if runtime.config.model.expert_residency else "index",
                expert_weights=features.expert_weights,
                linear_weights=features.linear_weights,
                cuda_graphs=features.cuda_graphs and features.forward == "paged" and on_cuda,
                graph_max_batch=features.cuda_graph_max_batch)  # fmt: skip
    del runtime
    release()
    return {key: {**info, **timing} for key, timing in out.items()}


def tokens_per_spec_step(args) -> float:
    """1 + the expected accepted drafts of `--mtp-k` drafts at `--acceptance` (1 without MTP)."""
    rates = [float(r) for r in args.acceptance.split(",")]
    if args.mtp_k > len(rates):
        raise SystemExit(f"--acceptance gives {len(rates)} positions; --mtp-k is {args.mtp_k}")
    return 1.0 + sum(rates[: args.mtp_k])


def spec_values(args) -> dict:
    """The worker's speculation settings for `--mtp-k` (none for 0)."""
    if not args.mtp_k:
        return {}
    return {"speculative.method": "mtp", "speculative.num_speculative_tokens": args.mtp_k}


# the staging runs' prefill buffer: --staging-experts (default 32: two halves of 16, ~408 MiB
# of V4-Flash MXFP4 experts)
STAGING = {"features.expert_staging": "--staging-experts"}
PREFETCH = {"features.expert_prefetch": True}
RUNS = {
    "paged": ("paged", {}),
    "paged_prefetch": ("paged", PREFETCH),
    "paged_staging": ("paged", STAGING),
    "paged_prefetch_staging": ("paged", {**PREFETCH, **STAGING}),
    "reference": ("reference", {}),
}  # run: (forward, the run's feature settings)
DEFAULT_RUNS = ("paged", "paged_prefetch", "reference")


def chosen_runs(args) -> dict[str, tuple[str, dict]]:
    """`--runs` (comma-separated names of RUNS), else every run the --no-* flags leave."""
    if args.runs:
        names = args.runs.split(",")
        unknown = [n for n in names if n not in RUNS]
        if unknown:
            raise SystemExit(f"--runs: unknown {unknown}; choose from {','.join(RUNS)}")
        return {n: RUNS[n] for n in names}
    skip = {n for n, off in (("paged_prefetch", args.no_prefetch),
                             ("reference", args.no_baseline)) if off}  # fmt: skip
    return {n: RUNS[n] for n in DEFAULT_RUNS if n not in skip}


def prompt_len(name: str, args) -> int:
    return {"full_depth_ttft": args.ttft_prompt,
            "full_depth_prefill": args.prefill_prompt}.get(name, args.prompt_len)  # fmt: skip


def timing_records(model_dir, args, on_run=None) -> list[dict]:
    """The records of the module doc, paged forward first; `on_run(records)` after each timed
    run with the records so far (a run's baseline and compute fields fill in once measured)."""
    from benchmarks.offload_serve_check import device_budget_gib, overrides

    batches = [int(b) for b in args.batches.split(",")]
    longest = max(args.ttft_prompt, args.prefill_prompt)
    step_tokens = max(longest, 128)
    max_len = -(-(longest + args.prompt_len + args.steps + 64) // 256) * 256
    shape = dict(max_seqs=args.max_seqs or max(batches), max_len=max_len, step_tokens=step_tokens,
                 warm_up=args.warm_up)  # fmt: skip
    paged = {**overrides(model_dir, args.device, "paged", **shape), **spec_values(args)}
    budget = args.device_memory_gib or device_budget_gib(load_config(paged), args.offload_share)
    offload = {"model.device_memory_gib": budget, "model.host_memory_gib": args.host_memory_gib,
               "cache.memory_fraction": args.memory_fraction}  # fmt: skip
    runs = chosen_runs(args)  # the paged forward, with pre-gated prefetch (A/B), the reference
    records: list[dict] = []
    for routing in args.routings.split(","):
        times: dict[str, dict] = {}
        for run, (forward, features) in runs.items():
            values = {**overrides(model_dir, args.device, forward, **shape), **offload,
                      **routing_values(routing, paged, Path(model_dir)),
                      "features.expert_prefetch": False, **features,
                      **spec_values(args)}  # fmt: skip
            if "features.expert_staging" in features:
                values["features.expert_staging"] = args.staging_experts
            started = time.perf_counter()
            times[run] = measure(values, args)
            print(f"timed {run} ({routing}): {time.perf_counter() - started:.1f} s "
                  f"{ {key: round(t['time_us']) for key, t in times[run].items()} }",
                  file=sys.stderr, flush=True)  # fmt: skip
            if on_run is not None:
                on_run(records + routing_records(times, {}, runs, routing, args))
        resident = {**paged, "model.random_routing": routing}
        compute = measure(resident, args) if resident_fits(resident) else {}
        records += routing_records(times, compute, runs, routing, args)
    return records


def routing_records(times: dict, compute: dict, runs: dict, routing: str, args) -> list[dict]:
    """One routing's records from its timed runs `times` {run: {(name, batch): timing}} and
    the all-resident `compute` ones ({} where it did not fit or has not run)."""
    records = []
    for run, timed in times.items():
        is_paged = runs[run][0] == "paged"
        for (name, batch), t in timed.items():
            base = times.get("reference", {}).get((name, batch)) if is_paged else None
            c = compute.get((name, batch)) if is_paged else None
            records.append(fill_compute(dict(
                name=name, batch=batch, routing=routing, mtp_k=args.mtp_k, layers=args.layers,
                prompt_len=prompt_len(name, args),
                **t, copy_floor_us=t["bytes_fetched"] / (COPY_GB_PER_S * 1e3),
                compute_us=c["time_us"] if c else None,
                copy_wait_us=t["time_us"] - c["time_us"] if c else None,
                baseline_time_us=base["time_us"] if base else None,
                speedup=base["time_us"] / t["time_us"] if base else None,
            )))  # fmt: skip
    return records


def fill_compute(record: dict) -> dict:
    """`compute_source` and, where no all-resident run measured compute_us, the step's own
    split (the module doc): the measured wait per token (an MTP step yields tokens_per_step).
    A record that has its `compute_source` already (the join tool reads written records) is
    kept as it is."""
    if "compute_source" in record:
        return record
    if record.get("compute_us") is not None:
        return {**record, "compute_source": "all_resident"}
    wait_us = record.get("copy_wait_measured_us")
    if wait_us is None:
        return {**record, "compute_source": None}
    wait_us /= record.get("tokens_per_step", 1.0)
    return {**record, "copy_wait_us": wait_us, "compute_us": record["time_us"] - wait_us,
            "compute_source": "step_minus_wait"}  # fmt: skip


def join_baseline(records: list[dict]) -> list[dict]:
    """Fill the paged records' baseline_time_us and speedup from reference records of the same
    (name, batch, routing, prompt_len, mtp_k), e.g. from a separate call (one 10-minute GPU
    call holds a 43-layer runtime or two, not all three runs)."""

    def key(r: dict) -> tuple:
        return r["name"], r["batch"], r["routing"], r["prompt_len"], r.get("mtp_k", 0)

    reference = {key(r): r["time_us"] for r in records if r["forward"] == "reference"}
    out = []
    for r in records:
        base = reference.get(key(r)) if r["forward"] == "paged" else None
        if base is not None:
            r = {**r, "baseline_time_us": base, "speedup": base / r["time_us"]}
        out.append(r)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(description="join the records of offload_serve_check "
                                     "calls (their `records`), baselines filled in")  # fmt: skip
    parser.add_argument("inputs", nargs="+", help="offload_serve_check --out files")
    parser.add_argument("--out", required=True, help="the joined list of records")
    args = parser.parse_args(argv)
    records = []
    for path in args.inputs:
        data = json.loads(Path(path).read_text())
        if isinstance(data, dict):  # offload_serve_check's output: its run facts go per record
            facts = {
                k: data[k] for k in ("shape", "device_memory_gib", "memory_fraction") if k in data
            }
            data = [{**facts, **r} for r in data["records"]]
        records += [fill_compute(r) for r in data]
    Path(args.out).write_text(json.dumps(join_baseline(records), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
