"""Prefill TTFT on one GPU: a lone prompt through the paged prefill path, each switch on and off.

    python -m benchmarks.bench_prefill --dry-run --out /tmp/p.json  # CPU: tiny model, ref path
    # On an H200 (results/prefill-h200.json), in two commands of < 10 min each:
    python -m benchmarks.bench_prefill --lengths 8192,32768  # ~3 min (8K ~1.5 s, 32K ~8 s)
    python -m benchmarks.bench_prefill --lengths 131072 --repeats 1 --merge   # ~6-7 min (~70 s/run)

Model: V4-Flash dimensions (`flash_config`, random bf16 weights via `random_model`) with
`--layers` ratios (default 0,4,128,4,128,4,128,4: four ratio-4 layers, so IndexCache frequency 2
is FSFS and 4 is FSSS) and `--experts` routed experts (default 32 instead of 256 to fit the
weights next to the reference attention's workspaces; top-6 routing keeps the per-token MoE
work of Flash). Cache: fp8 KV, MXFP4 indexer keys, 256-token blocks.

TTFT = wall time from the first chunk to the first token on the host, prefilling the prompt in
`--chunk`-token steps (default 2048) as the runner does, with the step-level `load_states`
from the paged cache, one model forward, `store_state` back (no scheduler: one request, no
queueing). Each length gets one full-length warm-up run first (the first timed config was
~10% slow without it); each point is the min of `--repeats` runs. Records (one per prompt
length and switch, shape "prompt=N,chunk=C"):
- index_cache_f2 / index_cache_f4 vs index cache off;
- shared_sparse_metadata on vs off (tables rebuilt per layer);
- all_on (IndexCache f2 + shared metadata) vs all_off.
The area chunk planner (#45061) sizes the sparse-kernel workspace of batched prefills; a lone
request has one chunk either way and the reference attention has no workspace, so it is
measured by tests/unit/test_chunk_planner.py (workspace rows), not here.
pct_roofline = useful FLOPs of an ideal sparse implementation (linears, indexer over the
visible keys of Full layers, attention over window + top-k / C128 entries) / time / 790 TFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.harness import PEAK_FLOPS, RESULTS_DIR
from dsv4.cache.layout import KVLayout
from dsv4.cache.manager import KVCacheManager
from dsv4.cache.packing import CacheOptions
from dsv4.config.index_pattern import IndexPattern
from dsv4.config.model import ModelConfig, flash_config, tiny_config
from dsv4.model.tiny import random_model
from dsv4.runner.kv_cache import PagedKVCache
from dsv4.runner.reference.cache_state import load_states, store_state
from dsv4.scheduler.batch import ScheduledRequest

DEFAULT_OUT = RESULTS_DIR / "prefill-h200.json"
GPU_LENGTHS = (8192, 32768, 131072)
DRY_LENGTHS = (96, 200)


@dataclass(frozen=True)
class Switches:
    index_freq: int = 0  # 0: IndexCache off; else every index_freq-th C4 layer is Full
    shared_metadata: bool = True

    def pattern(self, cfg: ModelConfig) -> IndexPattern:
        if not self.index_freq:
            return IndexPattern.all_full(cfg)
        return IndexPattern.from_freq(cfg, self.index_freq)


# (record name, measured switches, baseline name, baseline switches)
COMPARISONS = (
    ("index_cache_f2", Switches(2), "index_cache off", Switches(0)),
    ("index_cache_f4", Switches(4), "index_cache off", Switches(0)),
    ("shared_sparse_metadata", Switches(0, True), "metadata per layer", Switches(0, False)),
    ("all_on", Switches(2, True), "all off", Switches(0, False)),
)


def prefill_ttft_s(
    model, prompt: list[int], chunk: int, switches: Switches, dev
) -> tuple[float, int]:
    """Prefill `prompt` in `chunk`-token steps; -> (seconds to the first token, that token)."""
    cfg = model.cfg
    pattern = switches.pattern(cfg)
    model.set_index_pattern(pattern)
    kv_dtype, index_dtype = ("fp8", "mxfp4") if dev.type == "cuda" else ("fp32", "fp32")
    options = CacheOptions(256, kv_dtype, index_dtype, index_pattern=pattern.roles)
    layout = KVLayout.build(cfg, options)
    num_blocks = layout.num_blocks_for_request(len(prompt))
    cache = PagedKVCache(layout, num_blocks, device=dev)
    blocks = KVCacheManager(layout, num_blocks)
    blocks.allocate("r", len(prompt))
    dtype = model.embed.weight.dtype
    _sync(dev)
    start_s = time.perf_counter()
    for lo in range(0, len(prompt), chunk):
        ids = tuple(prompt[lo : lo + chunk])
        req = ScheduledRequest("r", ids, lo, True, 0, lo + len(ids) == len(prompt),
                               blocks.block_table("r"), blocks.ring_block_ids("r"))  # fmt: skip
        states = load_states(cache, (req,), dtype, shared_metadata=switches.shared_metadata)
        tokens = torch.tensor([ids], device=dev)
        logits = model(tokens, states=states, last_only=True).logits
        store_state(cache, req, states[0], req.start_position, req.end_position)
    first = int(logits[0, -1].argmax())  # host sync: the token is on the host
    elapsed = time.perf_counter() - start_s
    blocks.free("r")
    model.set_index_pattern(IndexPattern.all_full(cfg))
    return elapsed, first


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def useful_flops(cfg: ModelConfig, n: int, pattern: IndexPattern) -> float:
    """FLOPs of an ideal sparse prefill of n tokens (2 per multiply-add)."""
    d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    moe = (cfg.n_shared_experts + cfg.num_experts_per_tok) * 3 * d * cfg.moe_intermediate_size
    total = 0.0
    for layer in range(cfg.num_hidden_layers):
        r = cfg.layer_ratio(layer)
        params = d * cfg.q_lora_rank + cfg.q_lora_rank * h * hd + d * hd
        params += h * hd * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * d
        params += moe + d * cfg.n_routed_experts
        visible = n * cfg.sliding_window  # window keys summed over queries (upper bound)
        if r:
            params += 2 * d * cfg.overlap(r) * hd
            entries = n * n / (2 * r)  # sum over p of p / r
            visible += min(entries, n * cfg.index_topk) if r == 4 else entries
        if r == 4 and not pattern.is_shared(layer):
            params += cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim
            params += 4 * d * cfg.index_head_dim + d * cfg.index_n_heads
            total += 2 * cfg.index_n_heads * cfg.index_head_dim * n * n / 8
        total += 2 * params * n + 2 * 2 * h * hd * visible
    return total


def run(args: argparse.Namespace) -> list[dict]:
    dev = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:
        torch.set_num_threads(1)
        cfg, dtype = tiny_config().with_overrides(num_nextn_predict_layers=0), torch.float32
    else:
        ratios = tuple(int(r) for r in args.layers.split(","))
        cfg = flash_config(len(ratios), ratios).with_overrides(
            n_routed_experts=args.experts, num_nextn_predict_layers=0
        )
        dtype = torch.bfloat16
    model = random_model(cfg, seed=0, dtype=dtype, device=str(dev))
    chunk = args.chunk or (64 if args.dry_run else 2048)
    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else (
        DRY_LENGTHS if args.dry_run else GPU_LENGTHS)  # fmt: skip
    cache: dict[tuple[int, Switches], tuple[float, int]] = {}
    prompts: dict[int, list[int]] = {}

    def ttft(n: int, sw: Switches) -> tuple[float, int]:
        if n not in prompts:  # the same prompt for every switch; one full-length warm-up
            seeded = torch.Generator().manual_seed(n)
            prompts[n] = torch.randint(0, cfg.vocab_size, (n,), generator=seeded).tolist()
            prefill_ttft_s(model, prompts[n], chunk, Switches(0), dev)
        prompt = prompts[n]
        if (n, sw) not in cache:
            prefill_ttft_s(model, prompt[: 2 * chunk], chunk, sw, dev)  # warm-up of this layout
            runs = [prefill_ttft_s(model, prompt, chunk, sw, dev) for _ in range(args.repeats)]
            cache[(n, sw)] = (min(t for t, _ in runs), runs[0][1])
            print(f"prompt {n}: {sw} {cache[(n, sw)][0] * 1e3:.1f} ms", file=sys.stderr)
        return cache[(n, sw)]

    records = []
    with torch.no_grad():
        for n in lengths:
            for name, sw, base_name, base_sw in COMPARISONS:
                (t, tok), (bt, base_tok) = ttft(n, sw), ttft(n, base_sw)
                if sw.index_freq == base_sw.index_freq:
                    assert tok == base_tok, f"{name}: metadata changed the first token"
                flops = useful_flops(cfg, n, sw.pattern(cfg))
                records.append({
                    "name": f"ttft/{name}", "shape": f"prompt={n},chunk={chunk}",
                    "time_us": round(t * 1e6, 1), "baseline": base_name,
                    "baseline_time_us": round(bt * 1e6, 1), "speedup": round(bt / t, 3),
                    "pct_roofline": round(100 * flops / t / PEAK_FLOPS, 2),
                })  # fmt: skip
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, short prompts")
    p.add_argument("--out", default="", help=f"JSON records (default {DEFAULT_OUT})")
    p.add_argument("--lengths", default="", help="comma-separated prompt lengths")
    p.add_argument("--chunk", type=int, default=0, help="prefill tokens per step")
    p.add_argument("--layers", default="0,4,128,4,128,4,128,4", help="compress ratios")
    p.add_argument("--experts", type=int, default=32, help="routed experts per layer")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per point (min kept)")
    p.add_argument("--merge", action="store_true", help="keep --out's records of other shapes")
    args = p.parse_args(argv)
    records = run(args)
    out = Path(args.out) if args.out else DEFAULT_OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.merge and out.exists():
        new = {(r["name"], r["shape"]) for r in records}
        old = [r for r in json.loads(out.read_text()) if (r["name"], r["shape"]) not in new]
        records = old + records
    out.write_text(json.dumps(records, indent=1) + "\n")
    print(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
