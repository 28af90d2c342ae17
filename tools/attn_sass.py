"""The sparse-attention decode and indexer kernels compiled for sm_90 on the CPU, old vs new:
registers, spills (stack bytes), shared memory and the instruction mix of the main loop.

    TRITON_INTERPRET=0 python tools/attn_sass.py [--only SUBSTRING] [--dump DIR]

Arguments are specialised as a real launch specialises them: every pointer 16-byte aligned
(torch allocations), the strides below that are multiples of 16 too (without this the loads
compile byte by byte and the counts mislead). Shapes are V4-Flash's: 64 heads x 512 (rope 64,
584-B fp8_ds_mla rows, 128 window + 512 top-k candidates); indexer 64 heads x 128, E = 64
keys a block. "per byte" = warp instructions of the loop body over the HBM bytes it reads.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
from tools import moe_sass

ATTN_PTRS = {"q_ptr": "*bf16", "kv_ptr": "*u8", "kv16_ptr": "*bf16", "slot_ptr": "*i32",
             "wbase_ptr": "*i32", "sink_ptr": "*fp32", "o_ptr": "*bf16", "lse_ptr": "*fp32",
             "qk_scale_log2": "fp32"}  # fmt: skip
INDEX_PTRS = {"q_ptr": "*bf16", "w_ptr": "*fp32", "key_ptr": "*u8", "bt_ptr": "*i32",
              "t2r_ptr": "*i32", "len_ptr": "*i32", "out_ptr": "*fp32"}  # fmt: skip
ALIGNED_INTS = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_wt", "STRIDE_BT")
ROW = 584  # fp8_ds_mla bytes of a 512-d row
KEY_ROW = {1: 132, 2: 68}  # indexer key bytes: fp8_fp32scale, mxfp4


def _attn_cases():
    from kernels import sparse_attention as old
    from kernels import sparse_attention_heads as new

    base = dict(H=64, D=512, ROPE=64, ENTRY=ROW, NUM_WIN=128, DOT_BF16=True)
    out = []
    for bh, bn, w, s in old._GPU_CONFIGS:
        consts = dict(base, KV_FP8=True, SPLIT=True, BLOCK_H=bh, BLOCK_N=bn, BLOCK_D=512)
        # a head block of bh heads reads its BLOCK_N rows; 64 / bh blocks read them again
        out.append((f"attn old h{bh} n{bn} w{w} s{s}", old._attn_kernel, ATTN_PTRS, consts,
                    dict(num_warps=w, num_stages=s), bn * ROW * bh // 64))  # fmt: skip
    for bn, w, s, qk_t, lazy in new.SWEEP:
        consts = dict(base, SPLIT=True, BLOCK_H=64, BLOCK_N=bn, QK_T=qk_t, LAZY=lazy)
        out.append((f"attn new h64 n{bn} w{w} s{s} qkt{int(qk_t)} lazy{int(lazy)}", new._attn_heads_kernel, ATTN_PTRS, consts,
                    dict(num_warps=w, num_stages=s), bn * ROW))  # fmt: skip
    return out


def _index_cases():
    from kernels import indexer, indexer_select

    base = dict(HI=64, DI=128, E=64, STRIDE_KB=1 << 16, DOT_BF16=True, WRITE_TAIL=False,
                BLOCK_H=64)  # fmt: skip
    out = []
    for fmt in (1, 2):
        row = KEY_ROW[fmt]
        for fast in (False, True):
            for bn, w, s in indexer._GPU_CONFIGS:  # the autotuner's candidates
                consts = dict(base, STRIDE_KE=row, FMT=fmt, BLOCK_N=bn, FAST=fast)
                out.append((f"index {'new' if fast else 'old'} fmt{fmt} n{bn} w{w} s{s}",
                            indexer._logits_kernel, INDEX_PTRS, consts,
                            dict(num_warps=w, num_stages=s), bn * row))  # fmt: skip
    topk = dict(K=512, E=64, SLOTS_PER_BLOCK=64, SLOT_BASE=0, BLOCK=8192, BLOCK_K=512,
                ONE_CHUNK=True)  # fmt: skip
    ptrs = {"score_ptr": "*fp32", "len_ptr": "*i32", "t2r_ptr": "*i32", "bt_ptr": "*i32",
            "out_ptr": "*i32", "lens_ptr": "*i32"}  # fmt: skip
    for radix, warps in ((False, 16), (True, 8)):  # as launched; loop bytes: the 32 KB row
        out.append((f"index topk {'new' if radix else 'old'} 8192", indexer_select._topk_kernel,
                    ptrs, dict(topk, RADIX=radix), dict(num_warps=warps, num_stages=1),
                    8192 * 4))  # fmt: skip
    return out


def report(case, dump: Path | None) -> str:
    """tools/moe_sass.py's line for `case`, its pointers and aligned strides divisible by 16."""
    fn, ptrs, consts = case[1:4]
    params = list(inspect.signature(fn.fn).parameters)
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
             if p not in consts and (ptrs.get(p, "").startswith("*") or p in ALIGNED_INTS)}  # fmt: skip
    return moe_sass.report(case, dump, attrs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="")
    parser.add_argument("--dump", type=Path, default=None)
    args = parser.parse_args(argv)
    groups = [g for prefix, g in (("attn", _attn_cases), ("index", _index_cases))
              if prefix.startswith(args.only[:5]) or args.only[:5].startswith(prefix) or not args.only]  # fmt: skip
    moe_sass.print_reports((c for g in groups for c in g()), report, args.only, args.dump)
    return 0


if __name__ == "__main__":
    sys.exit(main())
