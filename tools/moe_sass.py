"""The MXFP4 MoE kernels compiled for sm_90 on the CPU: registers, spills, shared memory and the
instruction mix of the K loop a weight byte, so candidates can be compared before device time.

    TRITON_INTERPRET=0 python tools/moe_sass.py [--only SUBSTRING] [--dump DIR] [--unaligned]

Each case is one kernel of kernels/moe_gemm.py or kernels/moe_gemv.py at a served V4-Flash config.
The K loop is the SASS block between the last backward branch and its target; its instruction
counts are divided by the weight bytes one iteration reads (gate + up rows for w13).

Compiled as launched (`launch_attrs`): Triton's JIT specialises pointers and the integer
arguments outside a kernel's `sizes_vary` on divisibility by 16 (V4-Flash's sizes and strides
all are) and an argument equal to 1 (the scales' column stride) to a constant. `--unaligned`
compiles from the signature alone, as this tool did first: no load vectorises (1-byte weight
loads) and every case spilled, which the launched kernels do not.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import moe_gemm, moe_gemv, moe_w4a8

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
MMA_PTRS = {"x_ptr": "*bf16", "ids_ptr": "*i32", "tile_e_ptr": "*i32", "w_ptr": "*i8",
            "s_ptr": "*u8", "h_ptr": "*bf16", "limit": "fp32"}  # fmt: skip
W4A8_PTRS = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "ids_ptr": "*i32", "tile_e_ptr": "*i32",
             "w_ptr": "*i8", "s_ptr": "*u8", "h_ptr": "*fp8e4nv", "hs_ptr": "*fp32",
             "out_ptr": "*bf16", "limit": "fp32"}  # fmt: skip
GEMV_PTRS = {"xp_ptr": "*fp32", "ids_ptr": "*i32", "tile_e_ptr": "*i32", "w_ptr": "*i32",
             "s_ptr": "*u8", "hp_ptr": "*fp32", "limit": "fp32", "out_ptr": "*bf16"}  # fmt: skip
# instruction classes counted in the loop (SASS opcode prefixes)
CLASSES = ("LDG", "LDS", "STS", "BAR", "HGMMA", "QGMMA", "HMMA", "FFMA", "FMUL", "F2FP", "LOP3", "SHF",
           "IMAD", "PRMT", "SEL", "ISETP", "LDL", "STL")  # fmt: skip


def _mma_case(name, fmt, bm, bn, bk, warps, swap, stages=3):
    consts = dict(TOPK=6, FMT=fmt, SCALE_E8M0=True, HAS_LIMIT=True, BLOCK_M=bm, BLOCK_N=bn,
                  BLOCK_K=bk, GROUP_M=4, UPCAST=False, SWAP_AB=swap)  # fmt: skip
    # bytes an iteration: gate and up tiles, BLOCK_N rows of BLOCK_K/2 bytes each
    return (
        name,
        moe_gemm._w13_kernel,
        MMA_PTRS,
        consts,
        dict(num_warps=warps, num_stages=stages),
        (2 * bn * bk // 2),
    )


def cases():
    out = []
    # moe_mxfp4.mx_config's tiles at 16 / 1024 / 8192 tokens (8192: BLOCK_M 64), and BLOCK_M 128
    for tag, bm, bn, warps in (("decode", 16, 64, 4), ("1024", 32, 128, 8), ("8192", 64, 128, 8),
                               ("8192 m128", 128, 128, 8)):  # fmt: skip
        out.append(_mma_case(f"mma fmt2 {tag}", 2, bm, bn, 64, warps, True))
        for bk in (64, 128):
            out.append(_mma_case(f"dot_scaled bk{bk} {tag}", 3, bm, bn, bk, warps, True))
            out.append(_mma_case(f"halves{bk} {tag}", 4, bm, bn, bk, warps, True))
            out.append(_mma_case(f"halves{bk} smem {tag}", 4, bm, bn, bk, warps, False))
    # W4A8 (kernels/moe_w4a8.py: e4m3 MMA on the halves128 codes) at w4a8_config's tiles
    for tag, bm, warps in (("1024", 32, 8), ("8192", 64, 8), ("8192 m128", 128, 8)):
        for fn, per_iter in ((moe_w4a8._w13_w4a8_kernel, 2 * 128 * 64),
                             (moe_w4a8._w2_w4a8_kernel, 128 * 64)):  # fmt: skip
            consts = dict(UPCAST=False, BLOCK_M=bm, BLOCK_N=128, GROUP_M=4)
            if fn is moe_w4a8._w13_w4a8_kernel:
                consts.update(TOPK=6, HAS_LIMIT=True)
            kind = "w13" if fn is moe_w4a8._w13_w4a8_kernel else "w2"
            out.append((f"w4a8 {kind} {tag}", fn, W4A8_PTRS, consts,
                        dict(num_warps=warps, num_stages=3), per_iter))  # fmt: skip
    # the stored layout and the re-packed "mxfp4_halves128" one (kernels/moe_gemv.py HALVES) at
    # gemv_config's tiles: BLOCK_M 1 at 1 and 16 tokens, 2 at 64; w13 then w2 (BLOCK_N2 16)
    for halves, bm in ((False, 1), (False, 2), (True, 1), (True, 2)):
        tag = f"{' halves' if halves else ''} m{bm}"
        consts = dict(BLOCK_M=bm, BLOCK_W=64, POST_SCALE=True, HALVES=halves)
        out.append((f"gemv13{tag}", moe_gemv._gemv13_kernel, GEMV_PTRS,
                    dict(TOPK=6, HAS_LIMIT=True, BLOCK_N=8, **consts), dict(num_warps=4),
                    2 * 8 * 64 * 4))  # fmt: skip
        out.append((f"gemv2{tag}", moe_gemv._gemv2_kernel, GEMV_PTRS,
                    dict(BLOCK_N=16, **consts), dict(num_warps=4), 16 * 64 * 4))  # fmt: skip
    return out


def _signature(fn, ptrs, consts):
    import inspect

    params = inspect.signature(fn.fn).parameters
    return {p: "constexpr" if p in consts else ptrs.get(p, "i32") for p in params}


def launch_attrs(fn, ptrs, consts) -> tuple[dict, dict]:
    """(constexprs, attrs) as the JIT specialises a V4-Flash launch: `stride_sk` (the scales'
    column stride) is 1, pointers and the integer arguments outside `sizes_vary` divisible by 16."""
    import inspect

    params = list(inspect.signature(fn.fn).parameters)
    consts = {**consts, **({"stride_sk": 1} if "stride_sk" in params else {})}
    vary = set(fn.do_not_specialize)
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
             if p not in consts and p not in vary and ptrs.get(p, "i32")[0] in "*i"}  # fmt: skip
    return consts, attrs


def _loop_counts(sass: str) -> tuple[Counter, int]:
    """Opcode classes of the innermost-last K loop: the body of the last backward branch."""
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]
    addr = [int(re.search(r"/\*([0-9a-f]{4,})\*/", ln).group(1), 16) for ln in lines]
    best = None
    for i, ln in enumerate(lines):
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", ln)
        target = re.search(r"\.L_x_(\d+)", ln)
        if not m:
            continue
        if target:  # resolve the label to its address
            lbl = f".L_x_{target.group(1)}:"
            idx = sass.find(lbl)
            nxt = re.search(r"/\*([0-9a-f]{4,})\*/", sass[idx:]) if idx >= 0 else None
            to = int(nxt.group(1), 16) if nxt else None
        else:
            to = int(m.group(1), 16)
        if to is not None and to < addr[i]:
            size = addr[i] - to
            if best is None or size > best[1] - best[0]:
                best = (to, addr[i])
    counts = Counter()
    if best is None:
        return counts, 0
    body = [ln for ln, a in zip(lines, addr, strict=True) if best[0] <= a <= best[1]]
    for ln in body:
        op = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", ln)
        if op:
            head = op.group(1)
            if head.startswith("LDG.E"):  # the load widths: LDG.E.128 / .64 / (32-bit) / .U8
                counts[f"ldg{head.removeprefix('LDG.E') or '.32'}"] += 1
            for cls in CLASSES:
                if head.startswith(cls):
                    counts[cls] += 1
                    break
            else:
                counts["other"] += 1
    return counts, len(body)


def measure(case, dump: Path | None = None, attrs: dict | str | None = "launch") -> dict:
    """`case` compiled for sm_90: regs, stack (spill bytes), smem, loop (K-loop instructions),
    per_byte (warp instructions a weight byte), counts (the loop's opcode classes and load
    widths); `attrs`: ASTSource argument attributes (e.g. divisibility 16), "launch" for
    `launch_attrs`, None for the signature alone."""
    name, fn, ptrs, consts, opts, loop_bytes = case
    if attrs == "launch":
        consts, attrs = launch_attrs(fn, ptrs, consts)
    k = triton.compile(ASTSource(fn, _signature(fn, ptrs, consts), consts, attrs),
                       target=GPUTarget("cuda", 90, 32), options=opts)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        res = subprocess.run([BIN / "cuobjdump", "-res-usage", cubin], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
        sass = subprocess.run([BIN / "nvdisasm", "-c", cubin], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
        slug = re.sub(r"\W+", "_", name)
        (dump / f"{slug}.sass").write_text(sass)
        (dump / f"{slug}.ttgir").write_text(k.asm["ttgir"])
    counts, total = _loop_counts(sass)
    # warp instructions a weight byte: every warp runs the loop body once an iteration
    return dict(regs=int(re.search(r"REG:(\d+)", res).group(1)),
                stack=int(re.search(r"STACK:(\d+)", res).group(1)), smem=k.metadata.shared,
                loop=total, per_byte=total * opts.get("num_warps", 4) / loop_bytes,
                counts=counts)  # fmt: skip


def report(case, dump: Path | None, attrs: dict | str | None = "launch") -> str:
    """One line for `case` (`measure`)."""
    m = measure(case, dump, attrs)
    counts = m["counts"]
    mix = " ".join(f"{c}:{counts[c]}" for c in (*CLASSES, "other") if counts[c])
    widths = " ".join(f"{c}:{n}" for c, n in sorted(counts.items()) if c.startswith("ldg"))
    return (
        f"{case[0]:24s} regs {m['regs']:3d} stack {m['stack']:4d} smem {m['smem']:6d} loop "
        f"{m['loop']:4d} instr ({m['per_byte']:5.3f} warp instr a weight byte) {mix} [{widths}]"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="")
    parser.add_argument("--dump", type=Path, default=None)
    parser.add_argument("--unaligned", action="store_true",
                        help="compile from the signature alone (no launch specialisation)")  # fmt: skip
    args = parser.parse_args(argv)
    attrs = None if args.unaligned else "launch"
    print_reports(cases(), lambda c, d: report(c, d, attrs), args.only, args.dump)
    return 0


def print_reports(all_cases, report_fn, only: str, dump: Path | None) -> None:
    """One line a case whose name contains `only`; a failed compile is reported too."""
    for case in all_cases:
        if only in case[0]:
            try:
                print(report_fn(case, dump), flush=True)
            except Exception as exc:  # report every case
                print(f"{case[0]:24s} FAILED {type(exc).__name__}: {str(exc)[-300:]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
