"""End to end on one GPU (issue 12): router + prefill + decode processes against one colocated
engine, both driven by `dsv4 loadtest`, and transformers' DeepSeek-V4 on the same shape.

    python -m benchmarks.bench_e2e --out-dir benchmarks/results/e2e      # a GPU host
    python -m benchmarks.bench_e2e --dry-run --out-dir /tmp/e2e           # CPU smoke (tiny model)

Model: V4-Flash dimensions, layers 0,4,128,4, 256 routed experts, random bf16 weights served as
`--model random:DIR` (every process draws the same weights from the seed on its GPU). The MTP
layer is left out here: two processes each holding 5 x 12.9 GB of experts would not fit one
card next to each other (MTP is measured in benchmarks/bench_decode_graphs.py).

Per mode (disaggregated: 1 P + 1 D, KV over CUDA IPC; colocated: one engine, chunked prefill):
1. greedy probes: one 1024-token prompt (TTFT) and one 256-token decode (TPOT, batch 1) at
   concurrency 1, then 64 such decodes at once (TPOT, `--probe-concurrency`); written as
   `e2e_probe` records (mode, metric in ttft_1024 / tpot_b1 / tpot_c64, time_us) to
   `e2e-probes.json`;
2. a rate sweep: random prompts of 4608 x (1 +- 0.6) tokens (1.8K-7.4K) and 320 x (1 +- 0.6)
   output tokens (128-512), Poisson arrivals; goodput under `--goodput`.
Every run keeps its per-request JSONL; `e2e-summary.json` collects the table, the KV hand-off
share of TTFT (decode side `kv_transfer_ms` / TTFT) and the transformers baseline.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.engine_setup import model_config
from dsv4.commands.cluster import AUTO_PORTS, ClusterSpec, LocalCluster, free_port
from dsv4.config.model import ModelConfig
from dsv4.model.tiny import write_model_spec
from dsv4.serving.metrics import scrape

MODES = {"disaggregated": (1, ()), "colocated": (0, ("--role", "colocated"))}


def service_args(args) -> tuple[str, ...]:
    device = "cpu" if args.dry_run else "cuda"
    return ("--device", device, "--max-model-len", str(args.max_model_len),
            "--max-num-seqs", str(args.max_num_seqs), "--num-blocks", str(args.num_blocks),
            "--max-num-batched-tokens", str(args.budget), "--log-level", "warning",
            "--expert-weights", args.expert_weights, "--linear-weights", args.linear_weights,
            *args.extra_service_args)  # fmt: skip


def loadtest(target: str, out: Path, label: str, rate: str, num_prompts: int, input_len: int,
             output_len: int, ratio: float, args, concurrency: int = 0,
             greedy: bool = False) -> dict:  # fmt: skip
    """One `dsv4 loadtest` run -> its result JSON (per-request records in `label`.jsonl);
    `greedy`: temperature 0 (the probes), else the server's default sampling."""
    cmd = [sys.executable, "-m", "dsv4.commands.cli", "loadtest", "--target", target,
           "--dataset-name", "random", "--num-prompts", str(num_prompts),
           "--random-input-len", str(input_len), "--random-output-len", str(output_len),
           "--random-range-ratio", str(ratio), "--request-rate", rate, "--seed", "1",
           "--num-warmups", str(args.num_warmups),
           "--goodput", *args.goodput, "--timeout-s", "600", "--no-progress", "--label", label,
           "--result-json", str(out / f"{label}.json"),
           "--per-request-jsonl", str(out / f"{label}.jsonl")]  # fmt: skip
    if concurrency:
        cmd += ["--max-concurrency", str(concurrency)]
    if greedy:
        cmd += ["--temperature", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    print(done.stdout[-2500:], done.stderr[-1500:], flush=True)
    path = out / f"{label}.json"
    return json.loads(path.read_text()) if path.exists() else {"error": done.stderr[-800:]}


def handoff_share(jsonl: Path) -> dict:
    """Mean KV hand-off time (decode side) against mean TTFT, from per-request usage."""
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    ok = [r for r in rows if r.get("ttft_ms") and r.get("server_usage")]
    if not ok:
        return {}
    kv = sum(r["server_usage"]["kv_transfer_ms"] for r in ok) / len(ok)
    ttft = sum(r["ttft_ms"] for r in ok) / len(ok)
    return {"mean_kv_transfer_ms": kv, "mean_ttft_ms": ttft, "kv_share_of_ttft": kv / ttft}


def engine_steps(cluster: LocalCluster) -> dict:
    """Each worker's `dsv4_engine_*` counters (steps and seconds by kind) from its /metrics."""
    found: dict = {}
    for svc in cluster.services:
        if svc.role == "router" or not svc.metrics_port:
            continue
        try:
            samples = scrape(svc.metrics_url)
        except OSError as exc:
            found[svc.name] = {"error": repr(exc)}
            continue
        found[svc.name] = {k: v for k, v in samples.items() if k.startswith("dsv4_engine_")}
    return found


def gpu_processes(seconds: int = 3) -> subprocess.Popen | None:
    """`nvidia-smi pmon` for a few seconds (per-process SM %) while a probe runs, or None."""
    try:
        return subprocess.Popen(["nvidia-smi", "pmon", "-s", "u", "-c", str(seconds)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    except OSError:
        return None


def _start(mode: str, spec_dir: Path, out: Path, args, extra: tuple[str, ...]) -> LocalCluster:
    num_prefill, role_args = MODES[mode]
    spec = ClusterSpec(model_dir=f"random:{spec_dir}", router_port=free_port(),
                       num_prefill=num_prefill, num_decode=1,
                       service_args=(*service_args(args), *role_args, *extra),
                       log_dir=str(out / f"logs-{mode}{'-'.join(extra)}"), grace_s=15.0,
                       metrics_base_port=AUTO_PORTS)  # fmt: skip
    cluster = LocalCluster(spec)
    cluster.start(ready_timeout_s=600.0)  # a fresh host compiles every warm-up size class
    return cluster


def run_mode(mode: str, spec_dir: Path, out: Path, args) -> dict:
    result: dict = {"mode": mode, "cuda_graphs": not args.dry_run}
    started = time.monotonic()
    try:
        cluster = _start(mode, spec_dir, out, args, ())
    except Exception as exc:  # e.g. a graph capture failure: say so, serve eagerly
        result["start_error"] = repr(exc)[-1500:]
        result["cuda_graphs"] = False
        cluster = _start(mode, spec_dir, out, args, ("--no-cuda-graphs",))
    try:
        result["start_s"] = round(time.monotonic() - started, 1)
        target = cluster.router_address
        p = args.probe_scale
        result["probe_ttft_1024"] = loadtest(target, out, f"{mode}-ttft1024", "inf", 3 * p,
                                             args.probe_prompt, 1, 0.0, args, concurrency=1,
                                             greedy=True)  # fmt: skip
        result["steps_after_ttft_probe"] = engine_steps(cluster)
        pmon = None if args.dry_run else gpu_processes()
        result["probe_tpot_b1"] = loadtest(target, out, f"{mode}-tpot-b1", "inf", p,
                                           args.probe_prompt, args.probe_output, 0.0, args,
                                           concurrency=1, greedy=True)  # fmt: skip
        result["steps_after_tpot_probe"] = engine_steps(cluster)
        if pmon is not None:
            result["pmon_tpot_probe"] = pmon.communicate(timeout=30)[0][-3000:]
        if args.probe_concurrency:  # decode TPOT with that many streams at once
            c = args.probe_concurrency
            result[f"probe_tpot_c{c}"] = loadtest(target, out, f"{mode}-tpot-c{c}", "inf", c * p,
                                                  args.probe_prompt, args.probe_output, 0.0,
                                                  args, concurrency=c, greedy=True)  # fmt: skip
        sweep = []
        for rate, n in zip(args.rate_list, args.prompt_counts):
            label = f"{mode}-rate{rate}"
            res = loadtest(target, out, label, rate, n, args.input_len, args.output_len,
                           args.range_ratio, args)  # fmt: skip
            res["handoff"] = handoff_share(out / f"{label}.jsonl") if mode != "colocated" else {}
            sweep.append(res)
        result["sweep"] = sweep
        result["steps_after_sweep"] = engine_steps(cluster)
    finally:
        cluster.stop()
    return result


def transformers_baseline(cfg: ModelConfig, args) -> dict:
    """transformers' DeepseekV4ForCausalLM, random weights of the same shape, eager attention:
    TTFT of one 1024-token prompt and TPOT of greedy decoding at batch 1."""
    import torch

    try:
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    except ImportError as exc:
        return {"error": f"transformers has no DeepSeek-V4: {exc}"}
    device = "cpu" if args.dry_run else "cuda"
    hf_cfg = DeepseekV4Config(**cfg.with_overrides(linear_dtype="bf16").to_hf_dict())  # dense
    with torch.device(device):
        model = DeepseekV4ForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    ids = torch.randint(2, cfg.vocab_size, (1, args.probe_prompt), device=device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    with torch.no_grad():
        model(ids[:, :64])  # warm-up
        sync()
        t0 = time.perf_counter()
        out = model(ids, use_cache=True)
        sync()
        ttft = (time.perf_counter() - t0) * 1e3
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        steps = []
        for _ in range(args.hf_decode_steps):
            sync()
            t0 = time.perf_counter()
            out = model(token, past_key_values=past, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            sync()
            steps.append((time.perf_counter() - t0) * 1e3)
            past = out.past_key_values
    steps.sort()
    return {"ttft_1024_ms": ttft, "tpot_b1_ms": steps[len(steps) // 2],
            "decode_steps": len(steps)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model")
    ap.add_argument("--layers", default="0,4,128,4")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--modes", default="disaggregated,colocated")
    ap.add_argument("--rates", default="1,2,4,8")
    ap.add_argument("--prompts-per-rate", default="10,12,16,24")
    ap.add_argument("--input-len", type=int, default=4608)
    ap.add_argument("--output-len", type=int, default=320)
    ap.add_argument("--range-ratio", type=float, default=0.6)
    ap.add_argument("--probe-prompt", type=int, default=1024)
    ap.add_argument("--probe-output", type=int, default=256)
    ap.add_argument("--probe-scale", type=int, default=2)
    ap.add_argument("--probe-concurrency", type=int, default=64,
                    help="streams of the concurrent TPOT probe (0: none)")  # fmt: skip
    ap.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:50"])
    ap.add_argument("--max-model-len", type=int, default=8704)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--hf-decode-steps", type=int, default=32)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--num-warmups", type=int, default=2, help="per loadtest run")
    # one flag an occurrence, "=" form (argparse reads a bare "--flag" as its own option):
    # --extra-service-args=--async-scheduling --extra-service-args=--greedy-in-graph
    ap.add_argument("--extra-service-args", action="extend", nargs="*", default=[])
    ap.add_argument("--expert-weights", choices=("bf16", "checkpoint"), default="bf16",
                    help="routed experts served in bf16 or as the checkpoint's MXFP4")  # fmt: skip
    ap.add_argument("--linear-weights", choices=("bf16", "checkpoint"), default="bf16",
                    help="attention/shared-expert linears served in bf16 or as the checkpoint's "
                    "FP8 (128x128 block scales)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.dry_run:
        args.rates, args.prompts_per_rate, args.input_len, args.output_len = "4,8", "4,6", 96, 8
        args.probe_prompt, args.probe_output, args.probe_scale = 64, 6, 1
        args.max_model_len, args.num_blocks, args.budget = 512, 256, 512
        args.hf_decode_steps = 3
    args.rate_list = [r for r in args.rates.split(",") if r]  # "": the probes alone
    args.prompt_counts = [int(n) for n in args.prompts_per_rate.split(",") if n]
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    # no MTP layer (see the module doc); checkpoint experts: MXFP4, V4-Flash's format; checkpoint
    # linears: FP8 e4m3 with 128x128 block scales
    cfg = model_config(args.layers, args.experts, args.dry_run, expert_weights=args.expert_weights,
                       linear_weights=args.linear_weights)  # fmt: skip
    spec_dir = write_model_spec(out / "model", cfg)
    summary: dict = {"model": {"layers": args.layers, "experts": cfg.n_routed_experts,
                               "expert_weights": args.expert_weights,
                               "linear_weights": args.linear_weights, "hidden": cfg.hidden_size,
                               "dry_run": args.dry_run},
                     "service_args": list(args.extra_service_args)}  # fmt: skip
    for mode in args.modes.split(","):
        try:
            summary[mode] = run_mode(mode, spec_dir, out, args)
        except Exception as exc:  # one mode failing is a result too; keep the others
            summary[mode] = {"error": repr(exc)[-2000:]}
        (out / "e2e-summary.json").write_text(json.dumps(summary, indent=1))
    if not args.skip_transformers:
        try:
            summary["transformers"] = transformers_baseline(cfg, args)
        except Exception as exc:
            summary["transformers"] = {"error": repr(exc)[-2000:]}
    (out / "e2e-summary.json").write_text(json.dumps(summary, indent=1))
    (out / "e2e-probes.json").write_text(json.dumps(probe_records(summary), indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "model"}, indent=1)[:6000])
    return 0


def probe_records(summary: dict) -> list[dict]:
    """`e2e_probe` records (mode x metric, `time_us`: the probe's mean TTFT or TPOT) from a
    summary; a probe that did not run or failed gives time_us None and its error."""
    found = []
    for mode in MODES:
        result = summary.get(mode)
        if result is None:
            continue
        probes = {"ttft_1024": ("probe_ttft_1024", "mean_ttft_ms"),
                  "tpot_b1": ("probe_tpot_b1", "mean_tpot_ms")}  # fmt: skip
        probes |= {f"tpot_c{k.removeprefix('probe_tpot_c')}": (k, "mean_tpot_ms")
                   for k in result if k.startswith("probe_tpot_c")}  # fmt: skip
        for metric, (probe, key) in probes.items():
            run = result.get(probe, {})
            ms = run.get(key)
            found.append({"name": "e2e_probe", "mode": mode, "metric": metric,
                          "time_us": None if ms is None else ms * 1e3,
                          "completed": run.get("completed"), "failed": run.get("failed"),
                          "cuda_graphs": result.get("cuda_graphs"), "sampling": "greedy",
                          "model": summary.get("model", {}),
                          "service_args": summary.get("service_args", []),
                          "error": run.get("error") or result.get("error")})  # fmt: skip
    return found


if __name__ == "__main__":
    raise SystemExit(main())
