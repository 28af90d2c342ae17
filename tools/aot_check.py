"""Compile the Triton kernels the paged forward launches for sm_90 without a GPU (ptxas from
Triton's wheel), so a compile error or a register spill shows up before any device time.

    TRITON_INTERPRET=0 python tools/aot_check.py

Each case names a kernel, its argument types (pointer/scalar) and its constexprs, at the
served shapes (V4-Flash: head 512, rope 64, 64 heads; indexer 64 x 128).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

I32, I64, F32 = "i32", "i64", "fp32"


def _case(module, name, types, consts):
    fn = getattr(importlib.import_module(module), name)
    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: ("constexpr" if p in consts else types.get(p, I32)) for p in params}
    return f"{module}.{name} {consts}", fn, sig, consts


def cases():
    out = []
    for fmt, in_bf16 in ((0, True), (0, False), (1, True), (2, False)):
        entry = {0: 584, 1: 1024, 2: 2048}[fmt]
        used = {0: 583, 1: 1024, 2: 2048}[fmt]
        out.append(_case("kernels.kv_store", "_store_kernel",
                         {"rows_ptr": "*i16" if in_bf16 else "*fp32", "slot_ptr": "*i64",
                          "cache_ptr": "*u8"},
                         dict(D=512, ROPE=64, ENTRY=entry, USED=used, FMT=fmt, IN_BF16=in_bf16,
                              BLOCK_T=4, BLOCK_C=8, BLOCK_B=128 if fmt == 0 else 2048,
                              BLOCK_Z=1)))  # fmt: skip
    for fmt in (0, 1, 2):
        out.append(_case("kernels.kv_store", "_gather_kernel",
                         {"cache_ptr": "*u8", "slot_ptr": "*i64", "out_ptr": "*i16"},
                         dict(D=512, ROPE=64, FMT=fmt, OUT_BF16=True, BLOCK_N=4, BLOCK_C=8,
                              BLOCK_E=64 if fmt == 0 else 512)))  # fmt: skip
    for fmt, dim, ratio in ((0, 512, 4), (0, 512, 128), (1, 128, 4), (2, 128, 4), (3, 512, 4)):
        ptr = {p: "*fp32" for p in ("kv_ptr", "gate_ptr", "state_ptr", "cos_ptr", "sin_ptr")}
        ptr.update(
            pos_ptr="*i64",
            bnd_ptr="*i32",
            nis_ptr="*i32",
            win_ptr="*i64",
            slot_ptr="*i64",
            w_ptr="*bf16",
            cache_ptr="*u8",
            eps=F32,
        )
        for all_tokens in (False, True):
            out.append(_case("kernels.compressor", "_compress_kernel", ptr,
                             dict(D=dim, ROPE=64, RATIO=ratio, OVERLAP=ratio == 4, FMT=fmt,
                                  BLOCK_D=dim, BLOCK_C=min(2 * ratio if ratio == 4 else ratio,
                                                           4096 // dim),
                                  ALL_TOKENS=all_tokens)))  # fmt: skip
    attn = {"q_ptr": "*bf16", "kv_ptr": "*u8", "kv16_ptr": "*bf16", "slot_ptr": "*i32",
            "wbase_ptr": "*i32", "sink_ptr": "*fp32", "o_ptr": "*bf16", "lse_ptr": "*fp32",
            "qk_scale_log2": F32}  # fmt: skip
    for split, num_win, bh in ((False, 128, 16), (True, 128, 16), (False, 0, 64)):
        out.append(_case("kernels.sparse_attention", "_attn_kernel", attn,
                         dict(H=64, D=512, ROPE=64, ENTRY=584, KV_FP8=True, SPLIT=split,
                              NUM_WIN=num_win, DOT_BF16=True, BLOCK_H=bh, BLOCK_N=32,
                              BLOCK_D=512)))  # fmt: skip
    for split in (False, True):
        out.append(_case("kernels.sparse_attention_heads", "_attn_heads_kernel", attn,
                         dict(H=64, D=512, ROPE=64, ENTRY=584, SPLIT=split, NUM_WIN=128,
                              DOT_BF16=True, BLOCK_H=64, BLOCK_N=32, QK_T=True,
                              LAZY=True)))  # fmt: skip
    plain = dict(attn, kv_ptr="*bf16")
    out.append(_case("kernels.sparse_attention", "_attn_kernel", plain,
                     dict(H=64, D=512, ROPE=64, ENTRY=512, KV_FP8=False, SPLIT=False, NUM_WIN=0,
                          DOT_BF16=True, BLOCK_H=16, BLOCK_N=32, BLOCK_D=512)))  # fmt: skip
    for tail, fast in ((True, False), (False, False), (False, True)):
        out.append(_case("kernels.indexer", "_logits_kernel",
                         {"q_ptr": "*bf16", "w_ptr": "*fp32", "key_ptr": "*u8", "bt_ptr": "*i32",
                          "t2r_ptr": "*i32", "len_ptr": "*i32", "out_ptr": "*fp32"},
                         dict(HI=64, DI=128, E=64, STRIDE_KB=86432, STRIDE_KE=68,
                              FMT=2, DOT_BF16=True, WRITE_TAIL=tail, BLOCK_H=64,
                              BLOCK_N=128, FAST=fast)))  # fmt: skip
    out.append(_case("kernels.metadata", "_range_slots_kernel",
                     {"pos_ptr": "*i64", "t2r_ptr": "*i32", "bt_ptr": "*i32", "out_ptr": "*i32",
                      "lens_ptr": "*i32"},
                     dict(IS_WINDOW=False, ENTRIES_PER_BLOCK=2, SLOTS_PER_BLOCK=148, BLOCK_T=8,
                          BLOCK_W=128, WRITE_TAIL=True)))  # fmt: skip
    for ids, block_n, block_e, block_t in (("*i32", 512, 256, 512), ("*i64", 2048, 512, 4096)):
        out.append(_case("kernels.moe_align", "_align_kernel",
                         {"ids_ptr": ids, "sorted_ptr": "*i32", "tile_e_ptr": "*i32"},
                         dict(BLOCK_N=block_n, LOG_N=block_n.bit_length() - 1, BLOCK_E=block_e,
                              BLOCK_T=block_t, BLOCK_S=2048)))  # fmt: skip
    # the chunked align of prefill steps (kernels/moe_align.py launches A-C), E = 256 and 512
    for ids, block_e, block_m in (("*i32", 256, 64), ("*i64", 512, 1)):
        out.append(_case("kernels.moe_align", "_chunk_counts_kernel",
                         {"ids_ptr": ids, "counts_ptr": "*i32"},
                         dict(CHUNK_C=2048, BLOCK_E=block_e)))  # fmt: skip
        out.append(_case("kernels.moe_align", "_chunk_bases_kernel",
                         {"counts_ptr": "*i32", "base_ptr": "*i32", "stats_ptr": "*i32"},
                         dict(BLOCK_E=block_e)))  # fmt: skip
        out.append(_case("kernels.moe_align", "_chunk_scatter_kernel",
                         {"ids_ptr": ids, "base_ptr": "*i32", "stats_ptr": "*i32",
                          "sorted_ptr": "*i32", "tile_e_ptr": "*i32"},
                         dict(CHUNK_C=2048, LOG_C=11, BLOCK_E=block_e, BLOCK_TT=64,
                              BLOCK_M=block_m)))  # fmt: skip
    # the expert pool's slot table at V4-Flash's E = 256: resolve (i32/i64 ids), prefetch
    for ids, prefetch in (("*i32", False), ("*i64", False), ("*i64", True)):
        out.append(_case("kernels.expert_slots", "_resolve_kernel",
                         {"ids_ptr": ids, "table_ptr": "*i32", "owner_ptr": "*i32",
                          "last_ptr": "*i64", "cold_ptr": "*i32", "cnt_ptr": "*i64",
                          "fetch_ptr": "*i32", "rows_ptr": "*i32"},
                         dict(BLOCK=256, LOG_BLOCK=8, BLOCK_P=64, MAX_AGE_C=(1 << 20) - 1,
                              STEP_C=4, ERRORS_C=5, OVERFLOW=1, STALE=2, NO_HOST=4,
                              PREFETCH=prefetch, PREFETCHES_C=6)))  # fmt: skip
    copy = {f"{k}{i}": "*u8" for i in range(4) for k in ("d", "s")}
    copy.update(fetch_ptr="*i32", **{f"{k}{i}": I64 for i in range(4) for k in ("n", "t")})
    for parts in (2, 4):
        out.append(_case("kernels.expert_slots", "_copy_kernel", copy,
                         dict(NUM_PARTS=parts, CHUNK=1 << 15, BLOCK_B=4096)))  # fmt: skip
    # the pool's clock stamps around a layer's waits for copies (COPY_WAIT_MARK 8, _NS 7)
    out.append(_case("kernels.expert_slots", "_copy_wait_start_kernel", {"cnt_ptr": "*i64"},
                     dict(MARK=8)))  # fmt: skip
    for if_fetched in (False, True):
        out.append(_case("kernels.expert_slots", "_copy_wait_end_kernel",
                         {"cnt_ptr": "*i64", "fetch_ptr": "*i32" if if_fetched else "*i64"},
                         dict(MARK=8, WAIT=7, IF_FETCHED=if_fetched, BLOCK_S=256)))  # fmt: skip
    return out


def main() -> int:
    failed = 0
    for label, fn, sig, consts in cases():
        try:
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                               target=GPUTarget("cuda", 90, 32))  # fmt: skip
            print(f"ok    shared {k.metadata.shared:6d} B  {label}")
        except Exception as exc:  # report every case, then fail
            failed += 1
            cause = exc
            while cause.__cause__ or cause.__context__:
                cause = cause.__cause__ or cause.__context__
            print(f"FAIL  {label}\n      {type(cause).__name__}: {str(cause)[-400:]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
