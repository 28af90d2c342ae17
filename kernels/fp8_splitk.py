"""Split-K partials added inside the GEMM's own launch, in split order (deterministic).

The FP8 linears split K across programs when their output tiles alone leave SMs idle (decode
rows of the small linears: wkv [512, 4096] is 8 tiles of 64 rows). Today the fp32 partials
[S, T, G, N] are added by a second launch (`_fp8_linear_reduce_kernel` in kernels/fp8_gemv.py),
which costs a launch (~1.5-2.5 us on the H200 in a CUDA graph) where the whole GEMM of a small
linear takes 5-9 us. Here each program stores its partial, then takes a ticket from its output
tile's counter (one atomic add, acq_rel at GPU scope, after a CTA barrier so every thread's
stores come first); the program that draws the last ticket reads the S partials back in split
order 0..S-1, adds them in fp32 and stores y, then puts the counter back to 0. The sum's order
never depends on which program finished last, so y is the same bits on every run and under
any load: no float atomics. (The same pattern as CUTLASS's split-K "serial" reduction with a
semaphore, without its spin-wait: no program ever waits on another, so no deadlock.)

The counters live in one int32 buffer per device, zero when no launch is in flight (each
launch resets what it used), so CUDA-graph replays need no memset. Two launches that share the
buffer must not run at the same time on different streams: the model runs its linears on one
stream. The buffer is created outside any graph capture (the first launch of a warm-up).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.compressor import _bf16_rne
from kernels.fp8_dequant import _store_tile

COUNTERS = 1 << 16  # output tiles a launch may split (x groups); more: the reduce launch
_counters: dict[int, torch.Tensor] = {}


def tile_counters(device: torch.device) -> torch.Tensor:
    """The device's zeroed int32 [COUNTERS] ticket counters, made once (never inside a capture,
    where the memset would not run until a replay)."""
    key = device.index if device.type == "cuda" else -1
    if key not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fp8 split-K counters are made on the first eager launch; "
                               "run the linear once before capturing a CUDA graph")  # fmt: skip
        _counters[key] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _counters[key]


@triton.jit
def _last_split_adds(acc, part_ptrs, y_ptrs, mask, pid_s, num_splits, stride_os, count_ptr,
                     ROUND_OUT: tl.constexpr):  # fmt: skip
    """Store acc (any 2-D tile) as split pid_s's partial at part_ptrs + pid_s * stride_os; the
    program of the tile that finishes last stores y = sum over s in order 0..S-1 at y_ptrs."""
    tl.store(part_ptrs + pid_s.to(tl.int64) * stride_os, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial is written before the ticket is taken
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == num_splits - 1:
        total = tl.zeros_like(acc)
        for s in range(num_splits):  # .cg: from L2, where the other programs' partials are
            total += tl.load(part_ptrs + s * stride_os, mask=mask, other=0.0, cache_modifier=".cg")
        if ROUND_OUT:  # the interpreter truncates on the cast; the GPU rounds
            total = _bf16_rne(total)
        tl.store(y_ptrs, total.to(y_ptrs.dtype.element_ty), mask=mask)
        tl.atomic_xchg(count_ptr, 0)  # ready for the next launch (graph replays included)


@triton.jit
def _store_split(out_ptr, y_ptr, count_ptr, acc, rows, row_ok, g, n, n_ok, stride_os, stride_ot,
                 stride_og, TRANSPOSED: tl.constexpr, IN_KERNEL_REDUCE: tl.constexpr,
                 ROUND_OUT: tl.constexpr):  # fmt: skip
    """The linears' epilogue. acc [rows, n] (TRANSPOSED: [n, rows]) of program (tile, split,
    group g) = (program_id 0, 1, 2): stored at out [split, row, g, n] (y itself for one split,
    else fp32 partials [S, T, G, N] that a second launch adds), or IN_KERNEL_REDUCE: the
    partial stored and, by the tile's last program, y [T, G, N] (strides of out's [T, G, N])."""
    pid_s = tl.program_id(1)
    if IN_KERNEL_REDUCE:
        at = rows.to(tl.int64) * stride_ot + g * stride_og
        if TRANSPOSED:
            offs, mask = at[None, :] + n[:, None], n_ok[:, None] & row_ok[None, :]
        else:
            offs, mask = at[:, None] + n[None, :], row_ok[:, None] & n_ok[None, :]
        tile = g * tl.num_programs(0) + tl.program_id(0)
        _last_split_adds(acc, out_ptr + offs, y_ptr + offs, mask, pid_s, tl.num_programs(1),
                         stride_os, count_ptr + tile, ROUND_OUT)  # fmt: skip
    else:
        if ROUND_OUT:  # the interpreter truncates on the cast; the GPU rounds
            acc = _bf16_rne(acc)
        _store_tile(out_ptr, acc, pid_s, rows, row_ok, g, n, n_ok, stride_os, stride_ot,
                    stride_og, TRANSPOSED)  # fmt: skip


def in_kernel_reduce(cfg: dict, splits: int, tiles: int) -> bool:
    """Pop the "REDUCE" knob ("kernel": partials added inside the GEMM's launch; "pass", the
    default: by a second launch) and say whether this launch adds its partials in-kernel:
    only when it splits K, and its tiles (x groups) fit the counters."""
    how = cfg.pop("REDUCE", "pass")
    assert how in ("kernel", "pass"), f"REDUCE is 'kernel' or 'pass', not {how!r}"
    return how == "kernel" and splits > 1 and tiles <= COUNTERS
