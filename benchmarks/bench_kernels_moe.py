"""MoE experts, compressor step and sampling benchmarks on one GPU, each against its slow path.

    python -m benchmarks.bench_kernels_moe            # H200: writes results/kernels-moe-h200.json
    python -m benchmarks.bench_kernels_moe --dry-run --out /tmp/m.json  # CPU: tiny shapes, refs

Same record format and timing as benchmarks/bench_kernels.py ({"name", "shape", "time_us",
"baseline", "baseline_time_us", "speedup", "pct_roofline"}; pct_roofline is the larger of
bandwidth / 4.3 TB/s and FLOP/s / 790 TFLOP/s over compulsory traffic and work).
- moe_experts: V4-Flash (D 4096, I 2048, E 256, K 6) at 8192 tokens (compute-bound: the bf16
  target is >= 50% of 790 TFLOP/s) and 64 tokens (weight-bandwidth-bound), bf16 / FP8 / MXFP4
  weights, against the torch per-expert loop of `swiglu` (host-synchronising: do_bench).
  FLOPs = 6*T*K*D*I; bytes = the weights of the experts hit + x + y.
- moe_tile (`--only moe_tile`): the GEMMs' own configs at T = 1, 16, 64, 1024, 8192, each
  `tune` in TILE_TUNES against the default config (CUDA-graph replays). On the H200 (2026-12-04)
  SWAP_AB with 64-column tiles won at 1-64 tokens for FP8 and MXFP4 (1.05-1.35x) and lost from
  1024: `_config` turns it on at BLOCK_M 16. SWAP_AB computes each tile as W_tile @ x^T: the
  weight dequantised in registers becomes the MMA's A operand (Hopper's wgmma reads B from
  shared memory only) and its rows the M side (wgmma needs 64; the default 16- and 32-row tiles
  compile to mma.sync). bf16, whose weight tile is not built in registers, is the control and
  takes the plain swap only.
- moe_align: the routing metadata of a decode step (T 1 / 16 / 64, K 6, E 256, block_m 16):
  the one-launch kernel vs the ~14 torch ops of moe_align_ref; CUDA-graph replays.
- compressor_step: a decode step of 64 tokens with no window boundary (#48957): the save-only
  launch vs the always-launched compress kernel + save; CUDA-graph replays. Target >= 1.8x.
  Also a step where all 64 tokens complete a ratio-128 window (the compress kernel's own cost)
  against the torch reference.
- sample: FlashInfer top-k/top-p sampling vs the batched torch path at batch 64, vocab 129,280.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from benchmarks.harness import RESULTS_DIR, Case, bench_main, measure, start_run
from dsv4.ops.quant import fp8_block_quantize, mxfp4_quantize
from kernels import compressor, moe, sampling
from kernels.moe_align import moe_align, moe_align_ref

DEFAULT_OUT = RESULTS_DIR / "kernels-moe-h200.json"
GPU_SIZES = {"dim": 4096, "inter": 2048, "experts": 256, "k": 6, "moe_tokens": [8192, 64],
             "formats": ["bf16", "fp8", "mxfp4"], "decode": 64, "align_tokens": [1, 16, 64],
             "compressors": [(128, 512, "fp8_ue8m0"), (4, 512, "fp8_ue8m0"), (4, 128, "mxfp4")],
             "batch": 64, "vocab": 129280}  # fmt: skip
DRY_SIZES = {"dim": 64, "inter": 32, "experts": 4, "k": 2, "moe_tokens": [5],
             "formats": ["bf16", "mxfp4"], "decode": 3, "align_tokens": [3],
             "compressors": [(8, 64, "fp8_ue8m0"), (4, 64, "mxfp4")],
             "batch": 3, "vocab": 100}  # fmt: skip
GPU_SIZES["tile_tokens"] = [1, 16, 64, 1024, 8192]
GPU_SIZES["tile_formats"] = ["mxfp4", "fp8", "bf16"]
DRY_SIZES["tile_tokens"], DRY_SIZES["tile_formats"] = [3], ["mxfp4"]
# config overrides swept by moe_tile, each against the default config (BLOCK_M 16 at T <= 64,
# 32 at 1024, 64 at 8192; BLOCK_N 128; BLOCK_K 64; 4 warps, 8 at BLOCK_M 64). With SWAP_AB the
# BLOCK_N weight rows are the MMA's M side: 8 warps give each warpgroup 64 of them (compiled for
# sm_90, 4 warps sent the dequantised FP8 tile through shared memory, 8 did not). A tune that
# resolves to a config timed already at that T (8 warps at 8192) is skipped.
TILE_TUNES = ({"SWAP_AB": True}, {"SWAP_AB": True, "num_warps": 8},
              {"SWAP_AB": True, "BLOCK_M": 16, "BLOCK_N": 64},
              {"SWAP_AB": True, "BLOCK_K": 128, "num_warps": 8})  # fmt: skip


def bf16_experts(sizes, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """Random w13 [E, 2I, D] and w2 [E, D, I] bf16, scaled to unit-variance outputs."""
    e, d, i = sizes["experts"], sizes["dim"], sizes["inter"]
    w13 = torch.randn(e, 2 * i, d, device=dev, dtype=torch.bfloat16) / d**0.5
    w2 = torch.randn(e, d, i, device=dev, dtype=torch.bfloat16) / i**0.5
    return w13, w2


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor, fmt: str):
    """(w13, w2, s13, s2) in `fmt`, one expert at a time (bf16: as given, no scales)."""
    if fmt == "bf16":
        return w13, w2, None, None
    quant = fp8_block_quantize if fmt == "fp8" else mxfp4_quantize
    q13, s13 = zip(*(quant(w) for w in w13))
    q2, s2 = zip(*(quant(w) for w in w2))
    return torch.stack(q13), torch.stack(q2), torch.stack(s13), torch.stack(s2)


def _expert_weights(sizes, fmt, dev):
    return quantize_experts(*bf16_experts(sizes, dev), fmt)  # the bf16 copy is freed on return


def moe_step(dev, sizes, t, weights, fmt):
    """moe_experts' arguments for a step of t tokens, and its bytes (the weights of the experts
    hit + x + y) and FLOPs."""
    d, i, e, k = sizes["dim"], sizes["inter"], sizes["experts"], sizes["k"]
    x = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
    ids = torch.rand(t, e, device=dev).argsort(1)[:, :k].to(torch.int32)
    w = torch.rand(t, k, device=dev) + 0.1
    w13, w2, s13, s2 = weights
    per_expert = sum(a[0].numel() * a.element_size() for a in weights if a is not None)
    num_bytes = ids.unique().numel() * per_expert + t * d * 6
    return (x, ids, w, w13, w2, fmt, s13, s2, 10.0), num_bytes, 6.0 * t * k * d * i


def _moe_cases(dev, sizes, dry) -> Iterator[Case]:
    d, i, e, k = sizes["dim"], sizes["inter"], sizes["experts"], sizes["k"]
    for fmt in sizes["formats"]:
        weights = _expert_weights(sizes, fmt, dev)
        for t in sizes["moe_tokens"]:
            args, num_bytes, flops = moe_step(dev, sizes, t, weights, fmt)
            fn = moe.moe_experts_ref if dry else moe.moe_experts
            yield Case("moe_experts", f"T={t},D={d},I={i},E={e},K={k},{fmt}",
                       lambda f=fn, a=args: f(*a), "torch loop over experts (moe_experts_ref)",
                       lambda a=args: moe.moe_experts_ref(*a), num_bytes, flops,
                       graph=False)  # fmt: skip
        del weights


def _tile_cases(dev, sizes, dry) -> Iterator[Case]:
    def launch(args, tune):  # a dry run times the reference: `tune` is the kernel's
        tune = {"DEQUANT": False, "GEMV": False, **(tune or {})}  # in-register GEMMs, every size
        return moe.moe_experts_ref(*args) if dry else moe.moe_experts(*args, tune=tune)

    for fmt in sizes["tile_formats"]:
        weights = _expert_weights(sizes, fmt, dev)
        for t in sizes["tile_tokens"]:
            args, num_bytes, flops = moe_step(dev, sizes, t, weights, fmt)
            default = moe._config(t * sizes["k"], sizes["experts"], not dry, fmt)
            timed = [{"SWAP_AB": moe.SWAP_AB_DEFAULT, **default}]
            for tune in TILE_TUNES if fmt != "bf16" else TILE_TUNES[:1]:
                if {**timed[0], **tune} in timed:  # the default's or an earlier tune's config
                    continue
                timed.append({**timed[0], **tune})
                label = ",".join(f"{key}={v}" for key, v in tune.items())
                yield Case("moe_tile", f"T={t},{fmt},{label}",
                           lambda a=args, u=tune: launch(a, u), "default config",
                           lambda a=args: launch(a, None), num_bytes, flops,
                           graph=not dry)  # fmt: skip
        del weights


def _align_cases(dev, sizes, dry) -> Iterator[Case]:
    e, k, block_m = sizes["experts"], sizes["k"], 16
    fast = moe_align_ref if dry else moe_align
    for t in sizes["align_tokens"]:
        ids = torch.rand(t, e, device=dev).argsort(1)[:, :k].to(torch.int32)
        n = t * k
        out_bytes = (n // block_m + min(n, e)) * (block_m + 1) * 4  # sorted_ids + tile_e
        yield Case("moe_align", f"decode T={t},K={k},E={e},block_m={block_m}",
                   lambda a=ids: fast(a, e, block_m), "torch ops (moe_align_ref)",
                   lambda a=ids: moe_align_ref(a, e, block_m), n * 4 + out_bytes,
                   graph=not dry)  # fmt: skip


def _compressor_step(dev, tokens, ratio, dim, fmt, positions):
    """Step inputs for `tokens` decode requests at `positions`; boundary tables for those
    that complete a window, per-token tables for the always-launch path."""
    c = 2 if ratio == 4 else 1
    ring, rope, width = c * ratio, 64 if dim >= 128 else 32, c * dim
    kv = torch.randn(tokens, width, device=dev)
    gate = torch.randn(tokens, width, device=dev)
    state = torch.randn(tokens * ring, 2 * width, device=dev)
    req = torch.arange(tokens, device=dev)
    save = (req * ring + positions % ring).to(torch.int32)
    cand = positions[:, None] - c * ratio + 1 + torch.arange(c * ratio, device=dev)[None, :]
    rows = torch.where(cand >= 0, req[:, None] * ring + cand % ring, -1).to(torch.int32)
    ones = torch.ones(tokens, dtype=torch.int32, device=dev)
    cos, sin = torch.ones(tokens, rope // 2, device=dev), torch.zeros(tokens, rope // 2, device=dev)
    nbytes = compressor.entry_bytes(fmt, dim, rope)
    cache = torch.zeros(tokens, nbytes, dtype=torch.uint8, device=dev)
    weight = torch.ones(dim, device=dev, dtype=torch.bfloat16)
    slots = torch.arange(tokens, dtype=torch.int32, device=dev)
    bnd = torch.nonzero((positions + 1) % ratio == 0).flatten().to(torch.int32)
    boundary = (kv, gate, positions, state, save, bnd, ones[bnd.long()], rows[bnd.long()], weight,
                cos[bnd.long()], sin[bnd.long()], cache, slots[bnd.long()])  # fmt: skip
    per_token = (kv, gate, positions, state, save, bnd, ones, rows, weight, cos, sin, cache, slots)
    kw = dict(ratio=ratio, fmt=fmt, rope_dim=rope)
    return boundary, per_token, kw, tokens * width * 4 * 4


def _compressor_cases(dev, sizes, dry) -> Iterator[Case]:
    t = sizes["decode"]
    for ratio, dim, fmt in sizes["compressors"]:
        pos = 1000 * ratio + torch.arange(t, device=dev) % max(ratio - 1, 1)  # no boundary
        bnd, per_tok, kw, save_bytes = _compressor_step(dev, t, ratio, dim, fmt, pos)
        fast = compressor.compressor_step_ref if dry else compressor.compressor_step
        slow = compressor.compressor_step_ref if dry else compressor.compressor_step_always
        yield Case("compressor_step", f"decode T={t},r={ratio},d={dim},{fmt},no boundary",
                   lambda f=fast, a=bnd, k=kw: f(*a, **k), "always-launch compress + save",
                   lambda f=slow, a=per_tok, k=kw: f(*a, **k), save_bytes, graph=not dry)  # fmt: skip
    ratio, dim, fmt = sizes["compressors"][0]
    pos = 1000 * ratio + ratio - 1 + torch.zeros(t, dtype=torch.long, device=dev)  # all boundary
    bnd, _, kw, save_bytes = _compressor_step(dev, t, ratio, dim, fmt, pos)
    fast = compressor.compressor_step_ref if dry else compressor.compressor_step
    window_bytes = t * ratio * 2 * dim * 4
    yield Case("compressor_step", f"decode T={t},r={ratio},d={dim},{fmt},all boundary",
               lambda a=bnd, k=kw: fast(*a, **k), "compressor_step_ref (torch)",
               lambda a=bnd, k=kw: compressor.compressor_step_ref(*a, **k),
               save_bytes + window_bytes, graph=False)  # fmt: skip


def _sampling_cases(dev, sizes, dry) -> Iterator[Case]:
    if not dry and not sampling.flashinfer_available():
        print("sample: flashinfer not installed, skipped", flush=True)
        return
    b, v = sizes["batch"], sizes["vocab"]
    logits = torch.randn(b, v, device=dev) * 3
    temp = torch.full((b,), 0.8, device=dev)
    top_p = torch.full((b,), 0.9, device=dev)
    top_k = torch.full((b,), 50, dtype=torch.int32, device=dev)
    args = (logits, temp, top_p, top_k)
    fast = sampling.sample_ref if dry else sampling.sample
    yield Case("sample", f"B={b},V={v},top_k=50,top_p=0.9", lambda a=args: fast(*a),
               "batched torch (sort, cumsum, multinomial)",
               lambda a=args: sampling.sample_torch(*a), b * v * 4, graph=False)  # fmt: skip


def run(dry_run: bool, only: str = "") -> list[dict]:
    dev, sizes = start_run(dry_run, DRY_SIZES, GPU_SIZES, warm_up=False)
    # (case name, its generator): a generator whose cases `only` excludes is never started,
    # so `--only moe_align` does not first build 256 experts' weights in three formats
    gens = (("compressor_step", _compressor_cases), ("sample", _sampling_cases),
            ("moe_align", _align_cases), ("moe_experts", _moe_cases),
            ("moe_tile", _tile_cases))  # fmt: skip
    cases = (c for name, gen in gens if only in name for c in gen(dev, sizes, dry_run))
    return list(measure(cases, dry_run, only))


def main(argv: list[str] | None = None) -> int:
    return bench_main(__doc__.split("\n")[0], run, DEFAULT_OUT, argv)


if __name__ == "__main__":
    raise SystemExit(main())
