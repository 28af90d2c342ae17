"""The whole V4-Flash served by `dsv4 up` on one card (issue 22 item 4), measured by `dsv4 loadtest`.

    python -m benchmarks.full_depth_served --out $OUT/full-depth-served.json        # a GPU host
    python -m benchmarks.full_depth_served --shape tiny --layers 4 --device cpu \
        --device-memory-gib 0.05 --host-memory-gib 1 --out /tmp/s.json            # CPU rehearsal

`dsv4 up --model random:DIR` (DIR: the 43-layer V4-Flash config, MXFP4 experts and FP8 linears
served as stored) with `--layout auto`: the launcher plans the card, prints its plan line (why
colocated) and starts the router and the worker, whose start-up plan chooses the offload. Then
greedy `dsv4 loadtest` probes against the router, each its own run: a `--ttft-prompt`-token
prompt with one output token (TTFT), `--tpot-prompt`-token prompts with `--output-len` tokens
at concurrency 1 and at `--concurrency` (TPOT). After each probe the worker's /metrics give
the offload's counters (expert hit rate, bytes fetched, time waited for copies), as deltas.

Records `full_depth_served` (metric ttft_1024 / tpot_b1 / tpot_c16 at the defaults, time_us: the median per
request, p90_us, the loadtest result's completed / failed counts, hit_rate (the gauge after the
probe), bytes_fetched and copy_wait_s over the probe, start_s: `dsv4 up` to ready) and the
`dsv4 up` plan line in `plan_line`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.offload_serve_check import model_config
from dsv4.commands.cluster import free_port
from dsv4.model.tiny import write_model_spec
from dsv4.serving.metrics import scrape

UP_LINE = "dsv4 cluster up: router "
COUNTERS = ("dsv4_expert_bytes_fetched_total", "dsv4_expert_copy_wait_seconds_total")


def up_command(spec_dir: Path, args, log_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "dsv4.commands.cli", "up", "--model", f"random:{spec_dir}",
           "--layout", "auto", "--port", str(free_port()), "--log-dir", str(log_dir),
           "--ready-timeout-s", str(args.ready_timeout_s), "--grace-s", "20",
           "--device", args.device, "--expert-weights", "checkpoint",
           "--linear-weights", "checkpoint", "--host-memory-gib", str(args.host_memory_gib),
           "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.concurrency),
           "--max-num-batched-tokens", str(args.step_tokens), "--warm-up", "powers"]  # fmt: skip
    if args.device_memory_gib:
        cmd += ["--device-memory-gib", str(args.device_memory_gib)]
    return cmd


def wait_up(proc: subprocess.Popen, timeout_s: float) -> tuple[str, list[str]]:
    """(the 'cluster up' line, every line before it) once `dsv4 up` prints it; raises
    RuntimeError with its output when it exits or the time runs out first."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            lines.append(line.rstrip())
            print(line.rstrip(), file=sys.stderr, flush=True)
            if line.startswith(UP_LINE):
                return line.rstrip(), lines
            continue
        if proc.poll() is not None:
            raise RuntimeError(f"dsv4 up exited {proc.returncode}: " + " | ".join(lines[-8:]))
        time.sleep(0.2)
    raise RuntimeError(f"dsv4 up not ready in {timeout_s:.0f} s: " + " | ".join(lines[-8:]))


def worker_metrics_url(up_line: str) -> str:
    """The decode worker's /metrics URL from the 'cluster up' line (metrics NAME=URL ...)."""
    found = re.findall(r"(decode-\d+|colocated-\d+)=(\S+?/metrics)", up_line)
    if not found:
        raise RuntimeError(f"no worker metrics URL in: {up_line}")
    return found[0][1]


def offload_sample(url: str) -> dict[str, float | None]:
    """The offload's gauge and counters (None where the worker exports none: copy waits are
    timed by the paged forward's pool only)."""
    samples = scrape(url)
    return {k: samples.get(k) for k in ("dsv4_expert_hit_rate", *COUNTERS)}


def delta(before: dict, after: dict, key: str) -> float | None:
    a, b = before.get(key), after.get(key)
    return None if a is None or b is None else b - a


def probe(target: str, out: Path, label: str, prompts: int, input_len: int, output_len: int,
          concurrency: int) -> dict:  # fmt: skip
    """One greedy `dsv4 loadtest` run -> its result JSON (or {"error": ...})."""
    path = out / f"{label}.json"
    cmd = [sys.executable, "-m", "dsv4.commands.cli", "loadtest", "--target", target,
           "--dataset-name", "random", "--num-prompts", str(prompts),
           "--random-input-len", str(input_len), "--random-output-len", str(output_len),
           "--random-range-ratio", "0", "--request-rate", "inf", "--seed", "1",
           "--max-concurrency", str(concurrency), "--temperature", "0", "--ignore-eos",
           "--num-warmups", "1", "--timeout-s", "900", "--no-progress", "--label", label,
           "--result-json", str(path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    print(done.stdout[-1500:], done.stderr[-800:], file=sys.stderr, flush=True)
    return json.loads(path.read_text()) if path.exists() else {"error": done.stderr[-800:]}


def served_record(metric: str, result: dict, before: dict, after: dict, common: dict) -> dict:
    key = "ttft" if metric.startswith("ttft") else "tpot"
    median, p90 = result.get(f"median_{key}_ms"), result.get(f"p90_{key}_ms")
    return dict(name="full_depth_served", metric=metric, **common,
                time_us=None if median is None else median * 1e3,
                p90_us=None if p90 is None else p90 * 1e3,
                completed=result.get("completed"), failed=result.get("failed"),
                error=result.get("error"), hit_rate=after["dsv4_expert_hit_rate"],
                bytes_fetched=delta(before, after, COUNTERS[0]),
                copy_wait_s=delta(before, after, COUNTERS[1]))  # fmt: skip


def run(args, spec_dir: Path, work: Path) -> dict:
    result: dict = {"layers": args.layers, "records": []}
    started = time.monotonic()
    proc = subprocess.Popen(up_command(spec_dir, args, work / "logs"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        up_line, lines = wait_up(proc, args.ready_timeout_s + 60)
        result["start_s"] = round(time.monotonic() - started, 1)
        result["plan_line"] = next((x for x in lines if "layout" in x or "plan" in x), "")
        result["up_line"] = up_line
        target = up_line[len(UP_LINE) :].split(";")[0].strip()
        url = worker_metrics_url(up_line)
        common = dict(layers=args.layers, expert_weights="checkpoint", linear_weights="checkpoint",
                      start_s=result["start_s"])  # fmt: skip
        c = args.concurrency
        probes = ((f"ttft_{args.ttft_prompt}", 3, args.ttft_prompt, 1, 1),
                  ("tpot_b1", 2, args.tpot_prompt, args.output_len, 1),
                  (f"tpot_c{c}", 2 * c, args.tpot_prompt, args.output_len, c))  # fmt: skip
        for metric, prompts, input_len, output_len, concurrency in probes:
            before = offload_sample(url)
            res = probe(target, work, metric, prompts, input_len, output_len, concurrency)
            rec = served_record(metric, res, before, offload_sample(url), common)
            rec.update(concurrency=concurrency, prompt_len=input_len, output_len=output_len)
            result["records"].append(rec)
            save(result, args.out)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return result


def save(result: dict, out: str) -> None:
    if out:
        Path(out).write_text(json.dumps(result, indent=1))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="flash", choices=("flash", "tiny"))
    parser.add_argument("--layers", type=int, default=43)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--host-memory-gib", type=float, default=108.0)
    parser.add_argument("--device-memory-gib", type=float, default=0.0,
                        help="0: the card's memory")  # fmt: skip
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--step-tokens", type=int, default=1024)
    parser.add_argument("--ttft-prompt", type=int, default=1024)
    parser.add_argument("--tpot-prompt", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    parser.add_argument("--out", default="")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        spec_dir = write_model_spec(work / "model", model_config(args.shape, args.layers))
        try:
            result = run(args, spec_dir, work)
        except RuntimeError as exc:
            print(f"full_depth_served: {exc}", file=sys.stderr)
            return 1
    save(result, args.out)
    print(json.dumps(result["records"], indent=1))
    ok = all(r["failed"] == 0 and r["time_us"] for r in result["records"])
    return 0 if ok and result["records"] else 1


if __name__ == "__main__":
    sys.exit(main())
