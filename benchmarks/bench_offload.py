"""Expert offload on one GPU: a full-depth V4-Flash-shaped model whose random MXFP4 experts
(43 x 256 x 12.75 MiB = 137 GiB, ~155 GB of weights in all) exceed the card.

    python -m benchmarks.bench_offload                            # H200: results/offload-h200.json
    python -m benchmarks.bench_offload --dry-run --out /tmp/o.json  # CPU smoke: tiny config
    python -m benchmarks.bench_offload --layers 4 --gpu-mem-gib 12 --out /tmp/o.json  # GPU smoke

`dsv4.plan` decides how many experts per layer stay resident (the same plan a worker would
check at start-up); the rest go to pinned host memory. Weights are generated in memory on the
device (nothing is written to disk: the GPU host has 64 GiB of disk and 128 GiB of RAM); the
cold experts are generated on the GPU and streamed to pinned host memory one layer at a time.
Non-expert weights are held dequantised (bf16), as the reference torch model holds them.

Reports TTFT (prefill of `batch` prompts) and TPOT (mean decode step) at batch 1 and 16 with
the reference model's torch ops, the hot-expert hit rate during decode, and the bytes fetched.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness import RESULTS_DIR
from dsv4.config.model import ModelConfig, tiny_config
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.model.inventory import model_tensors
from dsv4.model.moe import MoE
from dsv4.model.offload import (
    ExpertFormat,
    OffloadedExperts,
    OffloadPolicy,
    offload_model,
    offload_stats,
)
from dsv4.model.tiny import random_model, random_tensor
from dsv4.ops.moe import swiglu
from dsv4.ops.quant import mxfp4_dequantize
from dsv4.plan import PlanRequest, WeightFormats, full_flash_config, plan_memory

DEFAULT_OUT = RESULTS_DIR / "offload-h200.json"
GIB = 1024**3
# log2 of the UE8M0 scale of random e2m1 codes (rms ~2.9) giving ~N(0, 1/fan_in) weights.
_SCALE_LOG2 = {"w1": -8, "w3": -8, "w2": -7}


def random_blobs(fmt: ExpertFormat, n: int, device: torch.device, gen: torch.Generator):
    """[n, nbytes] uint8: random e2m1 codes, one constant power-of-two scale per matrix."""
    blobs = torch.empty(n, fmt.nbytes, dtype=torch.uint8, device=device)
    offs = fmt.offsets
    for i, (name, shape, dtype) in enumerate(fmt.parts):
        cols = blobs[:, offs[i] : offs[i] + shape[0] * shape[1] * dtype.itemsize]
        if name.endswith("_scale"):
            cols.fill_(127 + _SCALE_LOG2[name[:2]])  # UE8M0 byte = exponent + 127
        else:
            cols.random_(0, 256, generator=gen)
    return blobs


def build_offloaded(cfg: ModelConfig, num_offloaded: int, slots: int, policy, seed: int, device):
    """The model on `device` with random MXFP4 experts generated straight into stores (never
    as bf16 modules); cold experts are streamed to (pinned, on CUDA) host memory per layer."""
    with torch.device("meta"):
        model = DeepseekV4(cfg)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in moes:
        moe.experts = torch.nn.ModuleList()  # experts live in the stores below
    model = model.to_empty(device=device).cast_(torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed)
    state = model.state_dict()
    with torch.no_grad(), torch.device(device):  # tiny.random_tensor's initialisers, on the GPU
        for spec in model_tensors(cfg, include_mtp=False):
            if spec.name in state:
                state[spec.name].copy_(random_tensor(spec, cfg, gen))
    fmt = ExpertFormat.mxfp4(cfg.hidden_size, cfg.moe_intermediate_size, torch.bfloat16)
    e = cfg.n_routed_experts
    resident_ids = list(range(e - num_offloaded))
    for moe in moes:
        resident = random_blobs(fmt, len(resident_ids), device, gen)
        cold = random_blobs(fmt, num_offloaded, device, gen)
        pinned = torch.empty(cold.shape, dtype=torch.uint8, pin_memory=device.type == "cuda")
        pinned.copy_(cold)
        del cold
        host = {len(resident_ids) + i: pinned[i] for i in range(num_offloaded)}
        moe.expert_store = OffloadedExperts(
            fmt, resident_ids, resident, host, slots, cfg.swiglu_limit, device, policy
        )
    return model.eval()


def layer_identical(model: DeepseekV4, device: torch.device) -> bool:
    """One layer's store (resident, cached and fetched experts) against a direct dequantise."""
    store = model.layers[len(model.layers) // 2].ffn.expert_store
    fmt = store.fmt
    u = torch.randn(4, fmt.parts[0][1][1] * 2, device=device).to(fmt.compute_dtype)
    store.prepare(torch.arange(len(store.resident_row) + len(store.host), device=device)[None])
    for e in sorted({*store.resident_row, *store.host}):
        blob = store.resident[store.resident_row[e]] if e in store.resident_row else store.host[e]
        v = fmt.views(blob.to(device))
        w = [mxfp4_dequantize(v[n], v[f"{n}_scale"], fmt.compute_dtype) for n in ("w1", "w2", "w3")]
        if not torch.equal(store.expert(e, 4)(u), swiglu(u, *w, store.limit)):
            return False
    return True


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def run_batch(model, batch: int, prompt_len: int, new_tokens: int, device, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=gen).to(device)
    states = [model.new_state() for _ in range(batch)]
    before = offload_stats(model)
    sync(device)
    start = time.perf_counter()
    token = model(ids, states=states, last_only=True).logits.argmax(-1)  # [B, 1]
    sync(device)
    ttft_s = time.perf_counter() - start
    prefill = offload_stats(model)
    steps, tokens = [], [token]
    for _ in range(new_tokens - 1):
        start = time.perf_counter()
        token = model(token, states=states, last_only=True).logits.argmax(-1)
        sync(device)
        steps.append(time.perf_counter() - start)
        tokens.append(token)
    after = offload_stats(model)
    decode = {k: getattr(after, k) - getattr(prefill, k) for k in after.__dataclass_fields__}
    uses = sum(decode[k] for k in ("resident_hits", "cache_hits", "misses", "cpu_computes"))
    cold = decode["cache_hits"] + decode["misses"] + decode["cpu_computes"]
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "ttft_ms": ttft_s * 1e3,
        "tpot_ms": sum(steps) / max(1, len(steps)) * 1e3,
        "hit_rate": (decode["resident_hits"] + decode["cache_hits"]) / max(1, uses),
        "cache_hit_rate": decode["cache_hits"] / max(1, cold),
        "decode_misses_per_step": decode["misses"] / max(1, len(steps)),
        "decode_bytes_fetched_per_step": decode["bytes_fetched"] / max(1, len(steps)),
        "prefill_misses": prefill.misses - before.misses,
        "tokens": torch.cat(tokens, dim=1).tolist(),
    }


def h2d_gb_per_s(device: torch.device, nbytes: int = GIB) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    sync(device)
    start = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    sync(device)
    return 3 * nbytes / (time.perf_counter() - start) / 1e9


def gpu_setup(args, policy) -> tuple[DeepseekV4, dict]:
    device = torch.device("cuda")
    cfg = full_flash_config().with_overrides(num_nextn_predict_layers=0)
    if args.layers < cfg.num_hidden_layers:  # a shallow smoke run of the same code
        ratios = cfg.compress_ratios[: args.layers]
        cfg = cfg.with_overrides(
            num_hidden_layers=args.layers,
            compress_ratios=ratios,
            num_hash_layers=min(cfg.num_hash_layers, args.layers),
        )
    total_b = args.gpu_mem_gib * GIB or torch.cuda.mem_get_info(device)[1]
    host_gib = _host_mem_gib()
    max_batch = max(args.batches)
    plan = plan_memory(
        PlanRequest(
            cfg,
            gpu_mem_gib=total_b / GIB,
            host_mem_gib=host_gib,
            max_model_len=args.prompt_len + args.new_tokens,
            max_num_seqs=max_batch,
            max_num_batched_tokens=max_batch * args.prompt_len,
            cuda_graphs=False,
            memory_fraction=args.memory_fraction,
            runtime_reserve_gib=args.reserve_gib,
            cache_slots=args.cache_slots,
            formats=WeightFormats(linears="bf16", experts="checkpoint"),
        )
    )
    if not plan.fits:
        raise SystemExit(plan.message)
    k = plan.offloaded_per_layer
    start = time.perf_counter()
    model = build_offloaded(cfg, k, plan.cache_slots, policy, args.seed, device)
    info = {
        "device": torch.cuda.get_device_name(device),
        "gpu_mem_gib": total_b / GIB,
        "host_mem_gib": host_gib,
        "plan_verdict": plan.verdict,
        "plan_message": plan.message,
        "num_layers": cfg.num_hidden_layers,
        "experts_per_layer": cfg.n_routed_experts,
        "offloaded_per_layer": k,
        "cache_slots": plan.cache_slots,
        "expert_bytes": model.layers[0].ffn.expert_store.fmt.nbytes,
        "host_pinned_gib": cfg.num_hidden_layers * k * plan.expert_bytes / GIB,
        "build_s": time.perf_counter() - start,
        "h2d_gb_per_s": h2d_gb_per_s(device),
        "identical_to_resident": layer_identical(model, device),
    }
    return model, info


def dry_setup(args, policy) -> tuple[DeepseekV4, dict]:
    """Tiny config on the CPU, built as on the GPU (5 of 8 random MXFP4 experts per layer
    offloaded through 2 cache slots); plus a resident-vs-offloaded full-model check."""
    cfg = tiny_config().with_overrides(num_nextn_predict_layers=0)
    device = torch.device("cpu")
    model = build_offloaded(cfg, 5, 2, policy, args.seed, device)
    resident = random_model(cfg, seed=args.seed)
    offloaded = random_model(cfg, seed=args.seed)
    offload_model(offloaded, num_offloaded=5, cache_slots=2, policy=policy)
    ids = torch.randint(0, cfg.vocab_size, (2, args.prompt_len), generator=torch.Generator())
    with torch.no_grad():
        same = torch.equal(offloaded(ids).logits, resident(ids).logits)
    info = {
        "device": "cpu (dry run, tiny config)",
        "num_layers": cfg.num_hidden_layers,
        "experts_per_layer": cfg.n_routed_experts,
        "offloaded_per_layer": 5,
        "cache_slots": 2,
        "identical_to_resident": same and layer_identical(model, device),
    }
    return model, info


def _host_mem_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / GIB
    return 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny config on the CPU")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--cache-slots", type=int, default=16, help="cold-expert slots per layer")
    p.add_argument("--eviction", choices=["lru", "lfu"], default="lru")
    p.add_argument("--memory-fraction", type=float, default=0.95)
    p.add_argument("--reserve-gib", type=float, default=6.0, help="context + reference activations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=43, help="fewer: a quick smoke run")
    p.add_argument("--gpu-mem-gib", type=float, default=0, help="plan for this (0: the card's)")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.dry_run:
        args.prompt_len, args.new_tokens = min(args.prompt_len, 24), min(args.new_tokens, 4)
    torch.manual_seed(args.seed)
    policy = OffloadPolicy(eviction=args.eviction)
    model, info = (dry_setup if args.dry_run else gpu_setup)(args, policy)
    device = next(model.parameters()).device
    vocab = model.cfg.vocab_size
    runs = []
    for batch in args.batches:
        run_batch(model, batch, min(args.prompt_len, 8), 2, device, vocab)  # warm-up
        runs.append(run_batch(model, batch, args.prompt_len, args.new_tokens, device, vocab))
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "tokens"}), flush=True)
    if device.type == "cuda":
        info["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    for run in runs:
        run.pop("tokens")
    result = {"benchmark": "expert offload", **info, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
