"""Issue 25's attention and indexer variants against today's kernels, one GPU, one run.

    python -m benchmarks.bench_kernels_attention --variants --out $OUT/attention-variants-h200.json
    python -m benchmarks.bench_kernels_attention --variants --dry-run --out /tmp/v.json  # CPU

Inputs and timing as benchmarks/bench_kernels_attention.py (V4-Flash shapes; input sets rotated
so that CUDA-graph replays read HBM; medians of graph replays; roofline 4.3 TB/s / 790 TFLOP/s
on compulsory bytes and FLOPs). Every pair runs on the same inputs in this process:
- "sparse_attention_decode", T = 64 and 128: `sparse_attention_decode_all_heads` (variant
  "all_heads", kernels/sparse_attention_heads.py) at each config of ATTN_TUNES, and the default
  kernel at the split-K counts of DEFAULT_SPLITS, against `sparse_attention_decode`
  (autotuned head blocks, its own split count: the baseline);
- "indexer_logits+topk", keys fp8 and mxfp4: `indexer_logits_topk` with the variants (fast
  logits, radix top-k) against the same call with the default kernels; "indexer_logits" and
  "indexer_topk" time each half alone.
Records: {name, T, variant, keys (indexer), shape, time_us, baseline_time_us, speedup,
pct_roofline, baseline_pct_roofline}; "attention_variants_numerics": each variant's output
against the reference on the first input set (max abs difference; top-k: same slot sets).
Dry run (CPU): tiny shapes; under TRITON_INTERPRET=1 (the kernel tests) the kernels
themselves run, so the GPU call cannot fail on a typo.
"""

from __future__ import annotations

import os
import time

import torch

from benchmarks.bench_kernels_attention import (
    DRY_SIZES,
    GPU_SIZES,
    _attention_sets,
    _index_sets,
    _kv_entry_bytes,
    _num_sets,
    _Rotate,
)
from benchmarks.bench_kernels_moe_gemv import cli
from benchmarks.harness import PEAK_BYTES_PER_S, PEAK_FLOPS, start_run, time_us
from kernels import indexer, indexer_fused, indexer_select, sparse_attention
from kernels import sparse_attention_heads as heads

# all_heads configs timed: (BLOCK_N, num_warps, num_stages), num_splits (None: one wave)
ATTN_TUNES = [(heads.GPU_CONFIG, None), ((32, 8, 1), None), ((16, 8, 2), None),
              (heads.GPU_CONFIG, 1), (heads.GPU_CONFIG, 4)]  # fmt: skip
# the default kernel's split-K counts timed against its own choice (about one wave of
# programs: 2 splits at T = 64, 1 at T = 128 on 132 SMs): is a decode step latency-bound?
DEFAULT_SPLITS = (1, 4, 8)
KEY_FORMATS = {"fp8": "fp8_fp32scale", "mxfp4": "mxfp4"}


def _pct(num_bytes: float, flops: float, t_us: float) -> float:
    s = t_us * 1e-6
    return round(max(num_bytes / s / PEAK_BYTES_PER_S, flops / s / PEAK_FLOPS) * 100, 2)


def _record(name, t, variant, shape, t_us, base_us, num_bytes, flops, **extra) -> dict:
    print(f"{name:20s} T={t:<4d} {variant:34s} {t_us:9.2f} us  base {base_us:9.2f} us  "
          f"x{base_us / t_us:5.2f}  {_pct(num_bytes, flops, t_us):5.1f}% roofline", flush=True)  # fmt: skip
    return {"name": name, "T": t, "variant": variant, **extra, "shape": shape,
            "time_us": round(t_us, 3), "baseline_time_us": round(base_us, 3),
            "speedup": round(base_us / t_us, 3), "pct_roofline": _pct(num_bytes, flops, t_us),
            "baseline_pct_roofline": _pct(num_bytes, flops, base_us)}  # fmt: skip


def _attention(dev, sz, dry, g) -> list[dict]:
    h, d, rope, cand = sz["heads"], sz["head_dim"], sz["rope"], sz["window"] + sz["topk"]
    records = []
    for t in sz["decode_tokens"]:
        row_bytes = t * cand * _kv_entry_bytes(d, rope)
        num_bytes, flops = row_bytes + 2 * t * h * d * 2 + t * cand * 4, 4.0 * t * h * cand * d
        sets, _ = _attention_sets(dev, t, sz, _num_sets(row_bytes, dry), g)
        shape = f"T={t},H={h},D={d},cand={sz['window']}+{sz['topk']},fp8_ds_mla"
        base_us = time_us(_Rotate(sparse_attention.sparse_attention_decode, sets), dry, True)
        expect = sparse_attention.sparse_attention_decode_ref(*sets[0]).float()
        variants = [(f"default splits={sp}",
                     lambda *a, sp=sp: sparse_attention.sparse_attention_decode(*a, num_splits=sp))
                    for sp in DEFAULT_SPLITS]  # fmt: skip
        for tune, splits in ATTN_TUNES:
            fn = lambda *a, tu=tune, sp=splits: heads.sparse_attention_decode_all_heads(  # noqa: E731
                *a, tune=tu, num_splits=sp
            )
            variants.append((f"all_heads n{tune[0]} w{tune[1]} s{tune[2]} "
                             f"splits={splits or 'auto'}", fn))  # fmt: skip
        for variant, fn in variants:
            t_us = time_us(_Rotate(fn, sets), dry, True)
            records.append(_record("sparse_attention_decode", t, variant, shape, t_us, base_us,
                                   num_bytes, flops))  # fmt: skip
            err = (fn(*sets[0]).float() - expect).abs().max().item()
            records.append({"name": "attention_variants_numerics", "T": t, "variant": variant,
                            "max_abs_diff": err})  # fmt: skip
    return records


def _indexer(dev, sz, dry, g) -> list[dict]:
    t, n, hi, di, e, k = (sz[x] for x in ("index_tokens", "index_keys", "index_heads",
                                          "index_dim", "index_block", "topk"))  # fmt: skip
    records = []
    for keys_name, fmt in KEY_FORMATS.items():
        row = di + 4 if fmt == "fp8_fp32scale" else di // 2 + di // 32
        key_bytes = t * n * row
        sets = _index_sets(dev, sz, fmt, row, _num_sets(key_bytes, dry), g)
        io, flops = t * hi * di * 2 + t * hi * 4 + t * k * 4, 2.0 * t * hi * n * di
        shape = f"T={t},keys={n},H_I={hi}x{di},k={k},{fmt}"

        def both(*a, v, f=fmt):
            return indexer_fused.indexer_logits_topk(*a, k, e, key_format=f, num_cols=n,
                                                     variant=v, radix=v)  # fmt: skip

        def logits(*a, v, f=fmt):
            return indexer.indexer_logits(*a, key_format=f, num_cols=n, write_tail=False, fast=v)

        scores = [logits(*s, v=False) for s in sets]  # the top-k alone reads these
        topk_sets = [(sc, s[5], k, s[4], s[3], e) for sc, s in zip(scores, sets, strict=True)]

        def topk(*a, v):
            return indexer_select.indexer_topk(*a, radix=v)

        for name, fn, arg_sets, num_bytes in (
            ("indexer_logits+topk", both, sets, key_bytes + io),
            ("indexer_logits", logits, sets, key_bytes + io + t * n * 4),
            ("indexer_topk", topk, topk_sets, t * n * 4 + t * k * 4),
        ):
            base_us = time_us(_Rotate(lambda *a, f=fn: f(*a, v=False), arg_sets), dry, True)
            t_us = time_us(_Rotate(lambda *a, f=fn: f(*a, v=True), arg_sets), dry, True)
            records.append(_record(name, t, "fast+radix", shape, t_us, base_us, num_bytes,
                                   flops if name != "indexer_topk" else 0.0, keys=keys_name))  # fmt: skip
        got, _ = both(*sets[0], v=True)
        want, _ = indexer_fused.indexer_logits_topk_ref(*sets[0], k, e, key_format=fmt,
                                                        num_cols=n)  # fmt: skip
        same = torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)
        records.append({"name": "attention_variants_numerics", "T": t, "keys": keys_name,
                        "variant": "fast+radix", "same_topk_as_reference": same})  # fmt: skip
    return records


def run(dry: bool, limit_s: float) -> list[dict]:
    if dry and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--variants --dry-run runs the kernels on the CPU: TRITON_INTERPRET=1")
    t0 = time.monotonic()
    dev, sizes = start_run(dry, DRY_SIZES, GPU_SIZES)
    records = _attention(dev, sizes, dry, torch.Generator().manual_seed(0))
    if time.monotonic() - t0 < limit_s:
        records += _indexer(dev, sizes, dry, torch.Generator().manual_seed(1))
    return records


def table(records: list[dict]) -> str:
    lines = ["| op | T | keys | variant | time | default | speedup | % roofline (default) |",
             "|---|---:|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in records:
        if "time_us" in r:
            lines.append(f"| {r['name']} | {r['T']} | {r.get('keys', '')} | {r['variant']} | "
                         f"{r['time_us']:.1f} us | {r['baseline_time_us']:.1f} us | "
                         f"{r['speedup']:.2f}x | {r['pct_roofline']:.0f} "
                         f"({r['baseline_pct_roofline']:.0f}) |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return cli(argv, __doc__.split("\n")[0], run, table, "attention_variants_numerics", 180.0)


if __name__ == "__main__":
    raise SystemExit(main())
