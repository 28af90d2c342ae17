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
The epilogue itself (`store_split`, `last_split_adds`) is @triton.jit code the three FP8
kernel modules call, so it lives in kernels/jit_helpers.py next to `store_tile`.
"""

from __future__ import annotations

import torch

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


def in_kernel_reduce(cfg: dict, splits: int, tiles: int) -> bool:
    """Pop the "REDUCE" knob ("kernel": partials added inside the GEMM's launch; "pass", the
    default: by a second launch) and say whether this launch adds its partials in-kernel:
    only when it splits K, and its tiles (x groups) fit the counters."""
    how = cfg.pop("REDUCE", "pass")
    assert how in ("kernel", "pass"), f"REDUCE is 'kernel' or 'pass', not {how!r}"
    return how == "kernel" and splits > 1 and tiles <= COUNTERS
