"""What the MTP layer still has to read of one request: the target's final streams.

MTP position j (docs/model.md#mtp) needs the target's final stream state at j (before
hc_head) and the token at j + 1. Those streams are not part of the paged cache, so the runner
keeps them here from the forward that produced them until the MTP consumes them (at the next
draft, when the token after the last position is known).

The MTP layer is window-only (ratio 0): its row at position j depends only on (streams_j,
token_{j+1}), and a query at p reads rows p - W + 1..p. Positions older than the last W can
therefore never be read again; `append` drops them (exact), which bounds the context of a
long prompt to W positions. `valid_from` says from where the MTP rows in the paged ring are
real: dropped or never-seen positions (a request adopted after a P->D hand-off starts fresh)
leave a gap before it, which the loader must not read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftContext:
    start: int  # position of tokens[0] / streams[0]; MTP rows of [valid_from, start) are stored
    valid_from: int
    tokens: list[int]  # token ids at positions start..end-1
    streams: torch.Tensor | None  # [n, M, D] target final streams at the same positions

    @classmethod
    def fresh(cls, position: int) -> DraftContext:
        """No MTP history: the next MTP position is `position` and nothing before it is valid."""
        return cls(position, position, [], None)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def num_pending(self) -> int:
        return len(self.tokens)

    def append(self, tokens: tuple[int, ...], streams: torch.Tensor, window: int) -> None:
        """Positions end..end+len(tokens)-1 were just computed: streams [n, M, D]."""
        assert streams.shape[0] == len(tokens)
        tokens_all = [*self.tokens, *tokens]
        streams_all = streams if self.streams is None else torch.cat((self.streams, streams))
        drop = max(0, len(tokens_all) - window)  # older rows are never read again
        self.tokens = tokens_all[drop:]
        # A copy: a view would pin the whole batch's streams tensor.
        self.streams = streams_all[drop:].clone()
        if drop:
            self.start += drop
            self.valid_from = self.start

    def consume(self, num_stored: int) -> None:
        """The MTP layer has read every pending position and stored the last `num_stored` rows
        of the ring; rows before those stay valid only if nothing was skipped."""
        end = self.end
        if end - num_stored > self.start:
            self.valid_from = end - num_stored
        self.start, self.tokens, self.streams = end, [], None
