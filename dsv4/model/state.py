"""Per-request cache of the reference model (not the paged engine cache).

One `SequenceState` holds everything a request needs to continue from `num_tokens` processed
tokens, so that "prefill in any chunks, then decode token by token" gives the same logits as
one full forward (docs/model.md#sequence-state):

- `LayerState.window`: the shared K=V rows of the last `sliding_window - 1` tokens, oldest
  first (a query sees those plus itself). Same content as the official 128-slot ring.
- `LayerState.compressor` / `.indexer`: a `CompressorState` per compressor (ratio > 0;
  the indexer's only for ratio 4):
    * `entries` [N, d']: every compressed entry emitted so far (entry i covers window i);
    * `pending_kv` / `pending_gate` [n < r, c*d'] fp32: projections (gate already + ape) of
      the tokens of the current, incomplete window;
    * `overlap_kv` / `overlap_gate` [r, d'] fp32 (ratio 4 only): the first halves of the last
      complete window, which the next window's entry also softmaxes over.
- `LayerState.stored_kv` / `CompressorState.stored` (set by the paged cache, None without
  one): what a row reads back as after the cache stored it (`decode(encode(rows))`). Rows of
  earlier steps come from the cache; a step's own fresh rows go through this round trip before
  attention / indexer scoring, so a token sees every row the same way whatever chunk it shared
  (chunk-size and batch invariance). The state keeps the raw rows: the cache encodes them once.
- `mtp`: the MTP layer's own `LayerState` (its sliding window), advanced by
  `DeepseekV4.mtp_forward`; `mtp_num_tokens` counts the positions it has seen.

Tensors live on the model's device; `clone()` gives an independent copy (prefix reuse tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dsv4.config.model import ModelConfig

RoundTrip = Callable[[torch.Tensor], torch.Tensor]  # rows [n, d] -> as read back, same dtype


@dataclass
class CompressorState:
    entries: torch.Tensor | None = None  # [N, d'] model dtype
    pending_kv: torch.Tensor | None = None  # [n, c*d'] fp32
    pending_gate: torch.Tensor | None = None  # [n, c*d'] fp32
    overlap_kv: torch.Tensor | None = None  # [r, d'] fp32, ratio 4 only
    overlap_gate: torch.Tensor | None = None  # [r, d'] fp32, ratio 4 only
    stored: RoundTrip | None = None  # the cache's round trip of entries (None: exact)

    @property
    def num_entries(self) -> int:
        return 0 if self.entries is None else int(self.entries.shape[0])

    def clone(self) -> CompressorState:
        tensors = (None if t is None else t.clone() for t in self._tensors())
        return CompressorState(*tensors, stored=self.stored)

    def _tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (
            self.entries,
            self.pending_kv,
            self.pending_gate,
            self.overlap_kv,
            self.overlap_gate,
        )


@dataclass
class LayerState:
    window: torch.Tensor | None = None  # [<= W-1, head_dim]
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None
    stored_kv: RoundTrip | None = None  # the cache's round trip of window rows (None: exact)

    def clone(self) -> LayerState:
        return LayerState(
            None if self.window is None else self.window.clone(),
            None if self.compressor is None else self.compressor.clone(),
            None if self.indexer is None else self.indexer.clone(),
            self.stored_kv,
        )

    def as_stored(self, kv: torch.Tensor) -> torch.Tensor:
        """Fresh window rows [S, hd] as the cache gives them back to later steps."""
        return kv if self.stored_kv is None else self.stored_kv(kv)


def new_layer_state(ratio: int) -> LayerState:
    return LayerState(
        compressor=CompressorState() if ratio else None,
        indexer=CompressorState() if ratio == 4 else None,
    )


@dataclass
class SequenceState:
    num_tokens: int = 0
    layers: list[LayerState] = field(default_factory=list)
    mtp: LayerState | None = None
    mtp_num_tokens: int = 0

    @classmethod
    def new(cls, cfg: ModelConfig) -> SequenceState:
        layers = [new_layer_state(r) for r in cfg.compress_ratios]
        mtp = new_layer_state(cfg.mtp_compress_ratio) if cfg.has_mtp else None
        return cls(0, layers, mtp, 0)

    def clone(self) -> SequenceState:
        return SequenceState(
            self.num_tokens,
            [layer.clone() for layer in self.layers],
            None if self.mtp is None else self.mtp.clone(),
            self.mtp_num_tokens,
        )
