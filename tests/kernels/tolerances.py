"""The one table of kernel-vs-reference tolerances, by output kind and dtype.

bf16 outputs: the interpreter truncates fp32 -> bf16 (torch rounds to nearest), so allow about
two bf16 ulps. fp32 router/hc values: only summation order differs (and 3xTF32 on the GPU).
"""

from __future__ import annotations

import torch

TOLERANCES: dict[tuple[str, torch.dtype], tuple[float, float]] = {
    # (kind, dtype): (atol, rtol)
    ("route_weights", torch.float32): (1e-6, 1e-5),
    ("hc_mix", torch.float32): (1e-5, 1e-4),  # post, comb: functions of fp32 GEMV outputs
    ("activation", torch.float32): (1e-5, 1e-4),  # u, h, x_new in fp32
    ("activation", torch.bfloat16): (1e-2, 1.6e-2),  # u, h, x_new in bf16
}


def tol(kind: str, dtype: torch.dtype) -> dict[str, float]:
    atol, rtol = TOLERANCES[(kind, dtype)]
    return {"atol": atol, "rtol": rtol}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, kind: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), **tol(kind, expected.dtype))
