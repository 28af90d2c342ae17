"""IndexCache's hand-off within one forward (arXiv 2603.12201; vLLM #49085 / #51209).

`TopkRelay` carries the Full ratio-4 layers' top-k to the Shared ones of the same forward; which
layer is which is the static `dsv4.config.index_pattern.IndexPattern`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsv4.config.index_pattern import IndexPattern

if TYPE_CHECKING:  # imports without torch: `dsv4 indexcache-search --help` builds its parser
    import torch


class TopkRelay:
    """One forward's hand-off of top-k indices from Full C4 layers to the Shared ones.

    Created by `DeepseekV4.forward` and passed down through the blocks; every Full layer
    `publish`es each batch row's top-k [S, k] (local entry indices, -1 padded), a Shared layer
    `take`s the row's top-k of its source layer. With `record=True` every Full layer's top-k
    is also kept (`recorded[layer_id][row]`, for the overlap report of indexcache-search).
    """

    def __init__(self, pattern: IndexPattern, record: bool = False) -> None:
        self.pattern = pattern
        self.record = record
        self.recorded: dict[int, dict[int, torch.Tensor]] = {}
        self._latest: dict[int, tuple[int, torch.Tensor]] = {}  # row -> (layer id, top-k)

    def is_shared(self, layer_id: int) -> bool:
        return self.pattern.is_shared(layer_id)

    def publish(self, layer_id: int, row: int, topk: torch.Tensor) -> None:
        if layer_id not in self.pattern.layer_ids:
            return  # the MTP layer's indexer feeds nobody
        self._latest[row] = (layer_id, topk)
        if self.record:
            self.recorded.setdefault(layer_id, {})[row] = topk

    def take(self, layer_id: int, row: int) -> torch.Tensor:
        source = self.pattern.source_of(layer_id)
        published = self._latest.get(row)
        if published is None or published[0] != source:
            raise RuntimeError(f"layer {layer_id} is Shared but layer {source} published no top-k")
        return published[1]
