"""Sparse attention and lightning-indexer benchmarks on one GPU, against torch and FlashInfer.

    python -m benchmarks.bench_kernels_attention        # H200: results/kernels-attention-h200.json
    python -m benchmarks.bench_kernels_attention --dry-run --out /tmp/a.json   # CPU: tiny, ref only
    python -m benchmarks.bench_kernels_attention --variants --out X.json   # issue 25: old vs new

Same record format and timing as benchmarks/bench_kernels.py ({"name", "shape", "time_us",
"baseline", "baseline_time_us", "speedup", "pct_roofline"}; medians of CUDA-graph replays).
Every case rotates over several input sets whose KV bytes together exceed the 50 MB L2, so
graph replays read HBM as a decode step does (the same candidate rows replayed back to back
would otherwise be L2 hits). Compulsory bytes: candidate rows read once + q + o (attention);
indexer keys read once + q + weights + slots (indexer); pct_roofline is the larger of
bandwidth / 4.3 TB/s and FLOP/s / 790 TFLOP/s, as in bench_kernels.py.

FlashInfer (`BatchMLAPagedAttentionWrapper`, fa3, ckv 512, kpe 0, page_size 1, one CSR row per
query token, causal=False) is the peer for sparse attention; it has no sink, so the sink is
applied from its LSE, o * sigmoid(lse_e - sink). Its fa3 path cannot read the 584-B fp8_ds_mla
rows, so it gets a bf16 pool (1024 B/row) and, where its per-tensor FP8 mode works, an e4m3
pool. Planning and index packing happen outside the timed region (favouring FlashInfer).
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Iterator

import torch

from benchmarks.harness import RESULTS_DIR, Case, bench_main, measure, start_run
from dsv4.ops.kv_codec import encode_rows
from kernels import indexer, indexer_select, sparse_attention

DEFAULT_OUT = RESULTS_DIR / "kernels-attention-h200.json"
L2_BYTES = 50e6
GPU_SIZES = {"heads": 64, "head_dim": 512, "rope": 64, "window": 128, "topk": 512,
             "decode_tokens": [64, 128], "prefill_tokens": 2048,
             "index_tokens": 64, "index_keys": 8192, "index_heads": 64, "index_dim": 128,
             "index_block": 64}  # fmt: skip
DRY_SIZES = {"heads": 4, "head_dim": 128, "rope": 64, "window": 8, "topk": 8,
             "decode_tokens": [3], "prefill_tokens": 5,
             "index_tokens": 3, "index_keys": 40, "index_heads": 4, "index_dim": 128,
             "index_block": 8}  # fmt: skip


class _Rotate:
    """Calls fn(*sets[i]) for i = 0, 1, 2, ... (mod len): each captured replay reads new bytes."""

    def __init__(self, fn, sets):
        self.fn, self.sets, self.i = fn, sets, 0

    def __call__(self):
        args = self.sets[self.i % len(self.sets)]
        self.i += 1
        return self.fn(*args)


def _num_sets(bytes_per_set: float, dry: bool) -> int:
    return 1 if dry else max(2, math.ceil(2.5 * L2_BYTES / bytes_per_set))


def _kv_entry_bytes(d, rope):
    nope = d - rope
    return nope + 2 * rope + -(-math.ceil(nope / 64) // 8) * 8


def _attention_sets(dev, t, sz, n_sets, g):
    """n_sets of (q, kv_cache fp8 rows, slots, sink, scale, kv rows fp32) over one shared pool."""
    h, d, rope, cand = sz["heads"], sz["head_dim"], sz["rope"], sz["window"] + sz["topk"]
    num_slots = n_sets * t * cand
    rows = torch.randn(num_slots, d, generator=g).to(dev)
    kv = encode_rows(rows, "fp8_ue8m0", _kv_entry_bytes(d, rope), rope)
    perm = torch.randperm(num_slots, generator=g).to(dev).int().view(n_sets, t, cand)
    sink = torch.randn(h, generator=g).to(dev)
    sets = [(torch.randn(t, h, d, generator=g).to(dev).bfloat16(), kv, perm[i].contiguous(),
             sink, d**-0.5) for i in range(n_sets)]  # fmt: skip
    return sets, rows


def _flashinfer_runner(sets, rows, fp8):
    """A callable like the op (q, kv, slots, sink, scale) on FlashInfer's MLA fa3 path, and its
    max error against our reference on set 0 (checks the sink-from-LSE correction)."""
    import flashinfer

    t, h, d = sets[0][0].shape
    dev = rows.device
    if fp8:
        amax = rows.abs().max().item()
        ckv_scale = amax / 448.0
        pool = (rows / ckv_scale).to(torch.float8_e4m3fn)[:, None, :]  # [slots, 1, 512]
        kwargs = {"ckv_scale": ckv_scale, "kpe_scale": 1.0}
    else:
        pool, kwargs = rows.bfloat16()[:, None, :], {}
    kpe = pool[..., :0]  # head_dim_kpe = 0
    wrappers = {}
    for _, _, slots, _, scale in sets:
        lens = (slots >= 0).sum(1).int()
        kv_indptr = torch.cat([lens.new_zeros(1), lens.cumsum(0).int()])
        w = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            torch.empty(128 << 20, dtype=torch.uint8, device=dev), backend="fa3"
        )
        w.plan(torch.arange(t + 1, dtype=torch.int32, device=dev), kv_indptr,
               slots[slots >= 0].contiguous(), lens, h, d, 0, 1, False, scale,
               q_data_type=torch.bfloat16, kv_data_type=pool.dtype)  # fmt: skip
        wrappers[slots.data_ptr()] = w
    base_e = "return_lse_base_on_e" in inspect.signature(w.run).parameters
    lse_kw = {"return_lse_base_on_e": True} if base_e else {}

    def run(q, kv, slots, sink, scale, lse_to_e):
        o, lse = wrappers[slots.data_ptr()].run(q, q[..., :0], pool, kpe, return_lse=True,
                                                **kwargs, **lse_kw)  # fmt: skip
        gate = torch.sigmoid(lse.float() * lse_to_e - sink[None, :])  # e^lse / (e^lse + e^sink)
        return (o.float() * gate[..., None]).to(o.dtype)

    expect = sparse_attention.sparse_attention_decode_ref(*sets[0]).float()
    errs = {f: (run(*sets[0], lse_to_e=f).float() - expect).abs().max().item()
            for f in (1.0, math.log(2.0))}  # fmt: skip
    best = min(errs, key=errs.get)  # the LSE base that reproduces the sink-corrected output
    return (lambda *a: run(*a, lse_to_e=best)), errs[best]


def _attention_cases(dev, sz, dry) -> Iterator[Case]:
    g = torch.Generator().manual_seed(0)
    h, d, rope = sz["heads"], sz["head_dim"], sz["rope"]
    cand = sz["window"] + sz["topk"]
    for name, t in [*(("sparse_attention_decode", t) for t in sz["decode_tokens"]),
                    ("sparse_attention_prefill", sz["prefill_tokens"])]:  # fmt: skip
        row_bytes = t * cand * _kv_entry_bytes(d, rope)
        num_bytes = row_bytes + 2 * t * h * d * 2 + t * cand * 4
        flops = 4.0 * t * h * cand * d
        sets, rows = _attention_sets(dev, t, sz, _num_sets(row_bytes, dry), g)
        op = getattr(sparse_attention, name if not dry else f"{name}_ref")
        ref = sparse_attention.sparse_attention_decode_ref
        shape = f"T={t},H={h},D={d},cand={sz['window']}+{sz['topk']},fp8_ds_mla"
        yield Case(name, shape, _Rotate(op, sets), "torch gather + decode_rows + softmax",
                       _Rotate(ref, sets), num_bytes, flops)  # fmt: skip
        if dry:
            continue
        for fp8 in (False, True):
            label = f"FlashInfer MLA fa3 {'e4m3 per-tensor' if fp8 else 'bf16'} KV + sink(LSE)"
            try:
                fi, err = _flashinfer_runner(sets, rows, fp8)
            except Exception as exc:  # ImportError, or a mode this FlashInfer build rejects
                print(f"skip {label}: {type(exc).__name__}: {exc}"[:300], flush=True)
                continue
            print(f"{label}: max |err| vs reference {err:.4f}", flush=True)
            yield Case(name, shape, _Rotate(op, sets), f"{label} (max err {err:.3f})",
                       _Rotate(fi, sets), num_bytes, flops)  # fmt: skip


def _index_sets(dev, sz, fmt, row_bytes, n_sets, g):
    """(q, w, keys view, block_table, token_to_req, lengths) per set, distinct key blocks."""
    t, n, hi, di, e = (sz[k] for k in ("index_tokens", "index_keys", "index_heads",
                                       "index_dim", "index_block"))  # fmt: skip
    blocks_per_req = -(-n // e)
    num_blocks = n_sets * t * blocks_per_req
    stride = -(-(e * row_bytes + 1024) // 256) * 256  # other layers' pages sit between
    backing = torch.zeros(num_blocks, stride, dtype=torch.uint8, device=dev)
    for b0 in range(0, num_blocks, 1024):  # encode in chunks (bounded fp32 temporaries)
        b1 = min(num_blocks, b0 + 1024)
        rows = torch.randn((b1 - b0) * e, di, generator=g).to(dev)
        backing[b0:b1, : e * row_bytes] = encode_rows(rows, fmt, row_bytes, 0).view(b1 - b0, -1)
    keys = backing[:, : e * row_bytes].view(num_blocks, e, row_bytes)
    perm = torch.randperm(num_blocks, generator=g).to(dev).int()
    perm = perm.view(n_sets, t, blocks_per_req)
    t2r = torch.arange(t, dtype=torch.int32, device=dev)
    lens = torch.full((t,), n, dtype=torch.int32, device=dev)
    scale = (di**-0.5) * (hi**-0.5)
    return [(torch.randn(t, hi, di, generator=g).to(dev).bfloat16(),
             torch.randn(t, hi, generator=g).to(dev) * scale, keys, perm[i].contiguous(), t2r,
             lens) for i in range(n_sets)]  # fmt: skip


def _indexer_cases(dev, sz, dry) -> Iterator[Case]:
    g = torch.Generator().manual_seed(1)
    t, n, hi, di, e, k = (sz[x] for x in ("index_tokens", "index_keys", "index_heads",
                                          "index_dim", "index_block", "topk"))  # fmt: skip
    for fmt, row_bytes in (("fp8_fp32scale", di + 4), ("mxfp4", di // 2 + di // 32)):
        key_bytes = t * n * row_bytes
        sets = _index_sets(dev, sz, fmt, row_bytes, _num_sets(key_bytes, dry), g)
        io = t * hi * di * 2 + t * hi * 4 + t * k * 4
        flops = 2.0 * t * hi * n * di
        logits = indexer.indexer_logits_ref if dry else indexer.indexer_logits
        topk = indexer_select.indexer_topk_ref if dry else indexer_select.indexer_topk

        def fused(q, w, keys, bt, t2r, lens, lg=logits, tk=topk, f=fmt):
            scores = lg(q, w, keys, bt, t2r, lens, key_format=f, num_cols=n)
            return tk(scores, lens, k, t2r, bt, e)

        def torch_path(q, w, keys, bt, t2r, lens, f=fmt):
            scores = indexer.indexer_logits_ref(q, w, keys, bt, t2r, lens, key_format=f,
                                                num_cols=n)  # fmt: skip
            return indexer_select.indexer_topk_ref(scores, lens, k, t2r, bt, e)

        shape = f"T={t},ctx={4 * n},keys={n},H_I={hi}x{di},k={k},{fmt}"
        yield Case("indexer_logits+topk", shape, _Rotate(fused, sets), "torch logits + sort",
                   _Rotate(torch_path, sets), key_bytes + io, flops)  # fmt: skip
        yield Case("indexer_logits", shape,
                   _Rotate(lambda *a, lg=logits, f=fmt: lg(*a, key_format=f, num_cols=n), sets),
                   "torch gather + decode_rows + einsum",
                   _Rotate(lambda *a, f=fmt: indexer.indexer_logits_ref(*a, key_format=f,
                                                                         num_cols=n), sets),
                   key_bytes + io + t * n * 4, flops)  # fmt: skip
    scores = torch.randn(t, n, generator=g).to(dev)
    _, _, _, bt, t2r, lens = sets[0]
    yield Case("indexer_topk", f"T={t},N={n},k={k}",
               lambda: (indexer_select.indexer_topk_ref if dry else indexer_select.indexer_topk)(
                   scores, lens, k, t2r, bt, e),
               "torch stable sort", lambda: indexer_select.indexer_topk_ref(scores, lens, k, t2r,
                                                                          bt, e),
               t * n * 4 + t * k * 4)  # fmt: skip
    short = lens.clamp(max=k)
    yield Case("indexer_select_all", f"T={t},k={k} (#49486)",
               lambda: (indexer_select.indexer_select_all_ref if dry
                        else indexer_select.indexer_select_all)(short, k, t2r, bt, e),
               "torch arange/where", lambda: indexer_select.indexer_select_all_ref(short, k, t2r,
                                                                                 bt, e),
               t * k * 4 + t * 8)  # fmt: skip


def run(dry_run: bool, only: str = "") -> list[dict]:
    dev, sizes = start_run(dry_run, DRY_SIZES, GPU_SIZES)
    cases = (c for gen in (_attention_cases, _indexer_cases) for c in gen(dev, sizes, dry_run))
    return list(measure(cases, dry_run, only))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--variants" in argv:  # issue 25's variants against these kernels, one GPU call
        from benchmarks import bench_attention_variants

        return bench_attention_variants.main([a for a in argv if a != "--variants"])
    return bench_main(__doc__.split("\n")[0], run, DEFAULT_OUT, argv)


if __name__ == "__main__":
    raise SystemExit(main())
