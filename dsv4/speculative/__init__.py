"""What both forwards' MTP speculation shares: the acceptance rules (greedy and rejection
sampling), a `Draft` and the acceptance counters (the per-request random stream is
`dsv4.runner.sampler.RequestRandom`; the acceptance measurement, `dsv4.engine.acceptance`).

Each forward owns its own speculative half: the reference forward's
`dsv4.runner.reference.speculative` (draft at the start of a step over per-request states,
verify, roll back to the accepted positions) and the paged forward's
`dsv4.runner.paged.speculative` (verify the previous step's drafts, accept, propose on the
cache).
"""

from dsv4.speculative.acceptance import (
    Draft,
    accept_greedy,
    accept_sampled,
    residual_probs,
)
from dsv4.speculative.metrics import SpecMetrics

__all__ = [
    "Draft",
    "SpecMetrics",
    "accept_greedy",
    "accept_sampled",
    "residual_probs",
]
