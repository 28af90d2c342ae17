"""Kernel micro-benchmarks on one GPU: each kernel against its slow path on the same inputs.

    python -m benchmarks.bench_kernels  # on an H200: writes results/kernels-h200.json
    python -m benchmarks.bench_kernels --dry-run --out /tmp/k.json  # CPU: tiny shapes, ref only

Times are medians of many timed repeats: `triton.testing.do_bench_cudagraph` (CUDA-graph
replay, no Python launch overhead) where the callable can be captured, else `do_bench`.
Each record: {"name", "shape", "time_us", "baseline", "baseline_time_us", "speedup",
"pct_roofline"}; pct_roofline is the larger of achieved bandwidth / 4.3 TB/s and achieved
FLOP/s / 790 TFLOP/s, counting each kernel's minimum (compulsory) traffic and work.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from benchmarks.harness import RESULTS_DIR, Case, bench_main, measure, start_run
from dsv4.ops.kv_codec import encode_rows
from kernels import metadata, mhc, routing
from kernels.kv_store import kv_store, kv_store_ref, min_entry_bytes
from kernels.norm_rope import norm_rope, norm_rope_ref, rope_ref
from kernels.norm_rope import rope as rope_kernel

DEFAULT_OUT = RESULTS_DIR / "kernels-h200.json"
M, ITERS, EPS = 4, 20, 1e-6


def _route_cases(dev, sizes, dry) -> Iterator[Case]:
    for num_experts, scale in sizes["experts"]:
        for t in sizes["route_tokens"]:
            logits = torch.randn(t, num_experts, device=dev) * 2
            bias = 8.0 + torch.rand(num_experts, device=dev) * 0.2
            fused = routing.route_ref if dry else routing.route
            yield Case("route", f"T={t},E={num_experts},k=6",
                       lambda f=fused, a=(logits, bias, 6, scale): f(*a),
                       "route_ref (unfused torch)",
                       lambda a=(logits, bias, 6, scale): routing.route_ref(*a),
                       t * num_experts * 4 + t * 6 * 8)  # fmt: skip
            tid2eid = torch.randint(0, num_experts, (129280, 6), device=dev, dtype=torch.int32)
            ids = torch.randint(0, 129280, (t,), device=dev)
            fused = routing.hash_route_ref if dry else routing.hash_route
            yield Case("hash_route", f"T={t},E={num_experts},k=6",
                       lambda f=fused, a=(logits, ids, tid2eid, scale): f(*a),
                       "hash_route_ref (unfused torch)",
                       lambda a=(logits, ids, tid2eid, scale): routing.hash_route_ref(*a),
                       t * (6 * 4 * 2 + 8 + 6 * 8))  # fmt: skip
            hash_topk = None if dry else _flashinfer_hash_topk(logits, ids, tid2eid, scale)
            if hash_topk is not None:
                yield Case("hash_route", f"T={t},E={num_experts},k=6",
                           lambda a=(logits, ids, tid2eid, scale): routing.hash_route(*a),
                           "flashinfer hash_topk", hash_topk,
                           t * (6 * 4 * 2 + 8 + 6 * 8))  # fmt: skip


def _flashinfer_hash_topk(logits, ids, tid2eid, scale):
    """FlashInfer's DSv4 hash router as a baseline, after checking it agrees with ours, or None.

    hash_topk's routed weights are sqrt(softplus)/sum without the routed scale; ours carry it,
    so ours / scale must equal theirs (same experts, same order: both read tid2eid rows).
    """
    try:
        from flashinfer.fused_moe.hash_topk import hash_topk
    except ImportError as exc:
        print(f"hash_route: flashinfer hash_topk unavailable ({exc}), skipped", flush=True)
        return None
    ids64 = ids.long().contiguous()
    theirs_w, theirs_e = hash_topk(logits, ids64, tid2eid)
    ours_w, ours_e = routing.hash_route(logits, ids64, tid2eid, scale)
    torch.testing.assert_close(ours_e, theirs_e)
    torch.testing.assert_close(ours_w / scale, theirs_w, rtol=1e-5, atol=1e-6)
    return lambda: hash_topk(logits, ids64, tid2eid)


def _mhc_cases(dev, sizes, dry) -> Iterator[Case]:
    d = sizes["hidden"]
    fn = torch.randn(24, M * d, device=dev) / (M * d) ** 0.5
    scale, base = torch.tensor([0.8, 1.2, 1.0], device=dev), torch.randn(24, device=dev) * 0.3
    h_fn, h_scale, h_base = fn[:M].contiguous(), scale[:1], base[:M]
    for t in sizes["hc_tokens"]:
        x = torch.randn(t, M, d, device=dev).bfloat16()
        y = torch.randn(t, d, device=dev).bfloat16()
        e = x[:, 0].contiguous()
        post, comb = torch.rand(t, M, device=dev), torch.rand(t, M, M, device=dev) / M
        pre_args = (x, fn, scale, base, ITERS, EPS, EPS)
        first_args = (e, fn, scale, base, ITERS, EPS, EPS)
        gemv = 2.0 * t * 24 * M * d
        yield Case("hc_pre", f"T={t},M=4,D={d}",
                   lambda a=pre_args: (mhc.hc_pre_ref if dry else mhc.hc_pre)(*a),
                   "hc_pre_ref (unfused torch)", lambda a=pre_args: mhc.hc_pre_ref(*a),
                   t * M * d * 2 + 24 * M * d * 4 + t * d * 2, gemv)  # fmt: skip
        yield Case("hc_pre_first_layer", f"T={t},M=4,D={d}",
                   lambda a=first_args: (mhc.hc_pre_first_layer_ref if dry
                                         else mhc.hc_pre_first_layer)(*a),
                   "repeat to 4 streams + fused hc_pre",
                   lambda a=first_args: (mhc.hc_pre_first_layer_ref if dry
                                         else mhc.hc_pre_first_layer_repeat)(*a),
                   t * d * 2 + 24 * M * d * 4 + t * d * 2, gemv)  # fmt: skip
        post_args = (y, x, post, comb)
        yield Case("hc_post", f"T={t},M=4,D={d}",
                   lambda a=post_args: (mhc.hc_post_ref if dry else mhc.hc_post)(*a),
                   "hc_post_ref (torch)", lambda a=post_args: mhc.hc_post_ref(*a),
                   t * M * d * 2 * 2 + t * d * 2)  # fmt: skip
        head_args = (x, h_fn, h_scale, h_base, EPS, EPS)
        yield Case("hc_head", f"T={t},M=4,D={d}",
                   lambda a=head_args: (mhc.hc_head_ref if dry else mhc.hc_head)(*a),
                   "hc_head_ref (unfused torch)", lambda a=head_args: mhc.hc_head_ref(*a),
                   t * M * d * 2 + M * M * d * 4 + t * d * 2, 2.0 * t * M * M * d)  # fmt: skip


def _metadata_cases(dev, sizes, dry) -> Iterator[Case]:
    for name, query_lens in sizes["batches"]:
        qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        qsl, t = qsl.to(dev), sum(query_lens)
        yield Case("token_to_req_indices", f"{name},T={t}",
                   lambda q=qsl, n=t: (metadata.token_to_req_indices_ref if dry
                                       else metadata.token_to_req_indices)(q, n),
                   "per builder: CPU repeat_interleave + H2D, x3",
                   lambda q=qsl, n=t: metadata.token_to_req_indices_per_builder(q, n),
                   t * 4, graph=False)  # fmt: skip
    t, w, width = sizes["prefill_tokens"], sizes["window"], sizes["c128_width"]
    pos = torch.arange(32768, 32768 + t, device=dev)
    t2r = torch.zeros(t, dtype=torch.int32, device=dev)
    table = torch.randperm(16384, device=dev)[: (32768 + t) // 64 + 1].int().view(1, -1)
    ref = dry  # dry run: the torch references stand in for both sides
    win = (pos, t2r, table, w, 64)
    yield Case("window_slot_table", f"T={t},window={w}",
               lambda a=win: (metadata.window_slot_table_ref if ref
                              else metadata.window_slot_table)(*a),
               "torch.full(-1) pre-fill + kernel",
               lambda a=win: (metadata.window_slot_table_ref if ref
                              else metadata.window_slot_table_prefill)(*a),
               t * w * 4 + t * 16)  # fmt: skip
    c128 = (pos, t2r, table, width, 2)
    yield Case("c128_index_table", f"T={t},width={width}",
               lambda a=c128: (metadata.c128_index_table_ref if ref
                               else metadata.c128_index_table)(*a),
               "torch.full(-1) pre-fill + kernel",
               lambda a=c128: (metadata.c128_index_table_ref if ref
                               else metadata.c128_index_table_prefill)(*a),
               t * width * 4 + t * 16)  # fmt: skip
    t4, topk = sizes["c4_tokens"], sizes["topk"]
    local = torch.randint(-1, 8192, (t4, topk), device=dev, dtype=torch.int32)
    t2r4 = torch.arange(t4, device=dev, dtype=torch.int32) % 64
    table4 = torch.randperm(64 * 256, device=dev)[: 64 * 128].int().view(64, 128)
    c4 = (local, t2r4, table4, 64)
    yield Case("c4_global_topk_slots", f"T={t4},topk={topk},E=64",
               lambda a=c4: (metadata.c4_global_topk_slots_ref if dry
                             else metadata.c4_global_topk_slots)(*a),
               "torch gather/where sequence", lambda a=c4: metadata.c4_global_topk_slots_ref(*a),
               t4 * topk * 8 + t4 * 8)  # fmt: skip


def _kv_store_cases(dev, sizes, dry) -> Iterator[Case]:
    d, rope, fmt = sizes["kv_dim"], 64, "fp8_ue8m0"
    entry = min_entry_bytes(fmt, d, rope)
    for t in sizes["kv_tokens"]:
        rows = torch.randn(t, d, device=dev).bfloat16()  # [T, D]
        cache = torch.zeros(sizes["kv_slots"], entry, dtype=torch.uint8, device=dev)
        slots = torch.randperm(cache.shape[0], device=dev)[:t].int()  # scattered, none -1
        op = kv_store_ref if dry else kv_store

        def torch_path(r=rows, c=cache, s=slots):  # no -1 slots: no boolean-mask sync
            c[s.long()] = encode_rows(r, fmt, entry, rope)

        yield Case("kv_store", f"T={t},D={d},{fmt}",
                   lambda f=op, a=(rows, cache, slots): f(*a, fmt=fmt, rope_dim=rope),
                   "encode_rows + index assignment (torch)", torch_path,
                   t * (d * 2 + entry + 4))  # fmt: skip


def _glue_cases(dev, sizes, dry) -> Iterator[Case]:
    """The attention layer's norm + rope glue: one launch against rms_norm then apply_rope."""
    d, heads, hd, rope = sizes["hidden"], sizes["heads"], sizes["head_dim"], sizes["rope_dim"]
    fast_nr = norm_rope_ref if dry else norm_rope
    fast_r = rope_ref if dry else rope_kernel
    for t in sizes["hc_tokens"]:
        x = torch.randn(t, d, device=dev).bfloat16()
        q = torch.randn(t, heads, hd, device=dev).bfloat16()
        w = torch.ones(d, device=dev)
        angles = torch.rand(t, rope // 2, device=dev) * 6.3
        cos, sin = angles.cos(), angles.sin()
        yield Case("norm_rope", f"rms_norm T={t},D={d}", lambda a=(x, w, 1e-6): fast_nr(*a),
                   "rms_norm (torch)", lambda a=(x, w, 1e-6): norm_rope_ref(*a),
                   t * d * 4 + d * 4)  # fmt: skip
        yield Case("norm_rope", f"q norm+rope T={t},H={heads},d={hd},rope={rope}",
                   lambda a=(q, None, 1e-6, cos, sin): fast_nr(*a),
                   "rms_norm + apply_rope (torch)",
                   lambda a=(q, None, 1e-6, cos, sin): norm_rope_ref(*a),
                   t * heads * hd * 4 + t * rope * 4)  # fmt: skip
        yield Case("rope", f"inverse T={t},H={heads},d={hd},rope={rope}",
                   lambda a=(q, cos, sin, True): fast_r(*a), "apply_rope (torch)",
                   lambda a=(q, cos, sin, True): rope_ref(*a),
                   t * heads * hd * 4 + t * rope * 4)  # fmt: skip


GPU_SIZES = {
    "experts": [(256, 1.5), (384, 2.5)],
    "route_tokens": [1, 64, 512, 8192],
    "hidden": 4096,
    "heads": 64, "head_dim": 512, "rope_dim": 64,
    "hc_tokens": [1, 64, 512, 8192],
    "batches": [("decode bs32", [1] * 32), ("decode bs256", [1] * 256),
                ("decode bs512", [1] * 512), ("mixed", [1] * 64 + [700, 300, 1024])],
    "prefill_tokens": 8192, "window": 128, "c128_width": 8192,
    "c4_tokens": 512, "topk": 512, "kv_tokens": [64, 8192], "kv_dim": 512,
    "kv_slots": 65536,
}  # fmt: skip
DRY_SIZES = {
    "experts": [(16, 1.5)], "route_tokens": [1, 5], "hidden": 32, "hc_tokens": [1, 3],
    "heads": 2, "head_dim": 16, "rope_dim": 8,
    "batches": [("decode bs4", [1] * 4), ("mixed", [1, 7])],
    "prefill_tokens": 9, "window": 8, "c128_width": 16, "c4_tokens": 5, "topk": 8,
    "kv_tokens": [3], "kv_dim": 128, "kv_slots": 16,
}  # fmt: skip


def run(dry_run: bool, only: str = "") -> list[dict]:
    dev, sizes = start_run(dry_run, DRY_SIZES, GPU_SIZES)
    cases = (
        c
        for gen in (_route_cases, _mhc_cases, _glue_cases, _metadata_cases, _kv_store_cases)
        for c in gen(dev, sizes, dry_run)
    )
    return list(measure(cases, dry_run, only))


def main(argv: list[str] | None = None) -> int:
    return bench_main(__doc__.split("\n")[0], run, DEFAULT_OUT, argv)


if __name__ == "__main__":
    raise SystemExit(main())
