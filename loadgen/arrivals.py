"""When each request is sent: offsets in seconds from the start of a run.

Conventions follow `vllm bench serve`: the first request goes at t = 0; `rate = inf` sends every
request at t = 0 (burst); Poisson arrivals draw gaps from a gamma distribution with shape
`burstiness` and mean 1/rate (burstiness 1 is exactly Poisson, < 1 burstier, > 1 more regular);
"constant" spaces requests exactly 1/rate apart. Trace workloads bring their own offsets.
`--max-concurrency` is applied later, by the runner, on top of these offsets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loadgen.workloads import LoadRequest

ARRIVAL_MODES = ("poisson", "constant")


@dataclass(frozen=True)
class ArrivalSpec:
    """How arrivals are drawn for one run. `request_rate` is requests/s (math.inf = burst)."""

    request_rate: float = math.inf
    mode: str = "poisson"
    burstiness: float = 1.0
    seed: int = 0
    use_trace_timestamps: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ARRIVAL_MODES:
            raise ValueError(f"arrival mode must be one of {ARRIVAL_MODES}, got {self.mode!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")


def arrival_offsets_s(num: int, spec: ArrivalSpec) -> list[float]:
    """Send offsets (seconds, non-decreasing, first = 0) for `num` requests."""
    if num <= 0:
        return []
    if math.isinf(spec.request_rate):
        return [0.0] * num
    if spec.mode == "constant":
        return [i / spec.request_rate for i in range(num)]
    rng = np.random.default_rng(spec.seed)
    scale = 1.0 / (spec.request_rate * spec.burstiness)
    gaps = rng.gamma(shape=spec.burstiness, scale=scale, size=num - 1)
    return [0.0, *(float(x) for x in np.cumsum(gaps))]


def schedule(requests: Sequence[LoadRequest], spec: ArrivalSpec) -> list[float]:
    """Offsets for `requests`: the trace's own offsets when every request has one and
    `spec.use_trace_timestamps` is set, else drawn by `arrival_offsets_s`."""
    timed = [r.arrival_offset_s for r in requests]
    if spec.use_trace_timestamps and timed and all(t is not None for t in timed):
        return [float(t) for t in timed]  # type: ignore[arg-type]
    return arrival_offsets_s(len(requests), spec)
