"""The reference (oracle) forward: `DeepseekV4.forward` over per-request states from the cache.

Reading path: `forward.py` (the `StepForward`) -> `cache_state.py` (a request's
`SequenceState` loaded from the paged cache and stored back) -> `slot_tables.py` (the step's
shared slot tables that load through). MTP: `speculative.py` (draft, verify, accept, store)
over `mtp_drafter.py` + `draft_context.py` (MTP drafting and its inputs) and `rollback.py`
(exact state after rejected drafts).
"""

from dsv4.runner.reference.forward import ReferenceForward, ReferenceOptions

__all__ = ["ReferenceForward", "ReferenceOptions"]
