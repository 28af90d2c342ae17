"""The paged forward: every step as one flat batch on the packed cache, through the kernels.

Reading path: `step.py` (a step as device tensors, shared metadata) -> `geometry.py` (where
each layer's pages are) -> `forward.py` (the layer loop, MoE) -> `attention.py` (one layer) ->
`compress.py`, `indexer.py`, `prefill.py` (workspaces), `kv_rows.py` (cache row codecs).
"""

from dsv4.runner.paged.forward import PagedForward, PagedOutput
from dsv4.runner.paged.forward_state import PagedSwitches
from dsv4.runner.paged.step import MetadataSwitches

__all__ = ["MetadataSwitches", "PagedForward", "PagedOutput", "PagedSwitches"]
