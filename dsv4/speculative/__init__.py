"""MTP speculative decoding: draft with the MTP layer, verify in one target forward, accept
(greedy or rejection sampling), keep only the accepted positions in the paged cache.

Reading path: `decoder.py` (the step), `drafter.py` + `context.py` (MTP drafting and its
inputs), `acceptance.py` (the rules), `rollback.py` (exact cache state), `metrics.py`.
"""

from dsv4.speculative.acceptance import accept_greedy, accept_sampled, residual_probs
from dsv4.speculative.context import DraftContext
from dsv4.speculative.decoder import SpeculativeDecoder
from dsv4.speculative.drafter import Draft, DraftJob, MTPDrafter
from dsv4.speculative.metrics import SpecMetrics
from dsv4.speculative.rollback import can_truncate, truncate_state

__all__ = [
    "Draft",
    "DraftContext",
    "DraftJob",
    "MTPDrafter",
    "SpecMetrics",
    "SpeculativeDecoder",
    "accept_greedy",
    "accept_sampled",
    "can_truncate",
    "residual_probs",
    "truncate_state",
]
