"""`dsv4 up --gpus`: which CUDA cards each worker process sees.

`--gpus N` asks for the first N cards, `all` for every one, a LIST (two or more indices, `0,2,3`)
for those: indices as CUDA numbers the cards the launcher sees (its CUDA_VISIBLE_DEVICES applies;
CUDA_DEVICE_ORDER=PCI_BUS_ID makes them nvidia-smi's). `place_workers` gives each worker whole
cards: prefill workers first, then decode workers, a worker of T ranks on the next T cards of
the selection. With fewer cards than that needs, every worker shares the selection's first
cards, as `dsv4 up` does without `--gpus` (`Placement.shared`: the layout plans each worker at
F/N). A worker of more ranks than the selection has cards is refused: its ranks would share a
card that the plan counts as theirs alone.

A worker gets its cards as CUDA_VISIBLE_DEVICES (`visible_devices`, set by `LocalCluster`), so
inside it they are cuda:0..T-1: `--device cuda` and the ranks' `cuda:r`
(`dsv4.parallel.ranks.rank_device`) need nothing else.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from dsv4.errors import UsageError

CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"
ALL = "all"
GPUS_HELP = "give N (the first N cards), all, or two or more card indices such as 0,2,3"


@dataclass(frozen=True)
class GpuRequest:
    """What `--gpus` asked: the first `count` cards, every card (`count` 0, no indices), or the
    listed `indices`."""

    text: str  # as typed, for messages
    count: int = 0
    indices: tuple[int, ...] = ()

    def cards(self, visible: int) -> tuple[int, ...]:
        """The cards asked, of `visible` ones; `UsageError` (one line) when they are not there."""
        seen = f"{visible} visible" if visible else "no CUDA card visible"
        if self.indices:
            missing = [i for i in self.indices if i >= visible]
            if missing:
                listed = f": 0..{visible - 1}" if visible else ""
                raise UsageError(f"--gpus {self.text}: no card {missing[0]} ({seen}{listed})")
            return self.indices
        if not visible:
            raise UsageError(f"--gpus {self.text}: {seen}")
        if self.count > visible:
            raise UsageError(f"--gpus {self.text}: {cards_text(self.count)} asked, {seen}")
        return tuple(range(self.count or visible))


def parse_gpus(text: str) -> GpuRequest:
    """`--gpus`'s argparse type: syntax only (the cards present are checked at start)."""
    text = text.strip()
    if text == ALL:
        return GpuRequest(text)
    if "," not in text:
        count = _number(text, text, "a card count")
        if count < 1:
            raise argparse.ArgumentTypeError(f"{text}: no card asked; {GPUS_HELP}")
        return GpuRequest(text, count=count)
    indices = tuple(_number(text, part.strip(), "a card index") for part in text.split(","))
    repeated = sorted({i for i in indices if indices.count(i) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"{text}: card {repeated[0]} is named twice")
    return GpuRequest(text, indices=indices)


def _number(text: str, part: str, what: str) -> int:
    if not (part.isascii() and part.isdigit()):  # no sign, no blank: "-1" and "" are not cards
        raise argparse.ArgumentTypeError(f"{text}: {part!r} is not {what}; {GPUS_HELP}")
    return int(part)


@dataclass(frozen=True)
class WorkerCards:
    name: str  # as `LocalCluster` names the worker: prefill-0, decode-1
    ranks: int
    cards: tuple[int, ...]  # the launcher's indices; inside the worker cuda:0..len-1


@dataclass(frozen=True)
class Placement:
    """Each worker's cards, in start order; `shared`: too few cards for one each, so every
    worker sees the selection's first cards (as without `--gpus`)."""

    workers: tuple[WorkerCards, ...]
    selection: tuple[int, ...]
    shared: bool = False

    def cards_of(self, name: str) -> tuple[int, ...]:
        """The worker's cards; () for one this placement does not name."""
        return next((w.cards for w in self.workers if w.name == name), ())

    @property
    def needed(self) -> int:
        """Cards for a card per rank of every worker."""
        return sum(w.ranks for w in self.workers)

    @property
    def text(self) -> str:
        """Where the workers run, for the plan line."""
        if self.shared:
            given = len(self.selection)
            return f"{self.needed} GPUs needed for cards of their own, --gpus gives {given}"
        used = {c for w in self.workers for c in w.cards}
        idle = [c for c in self.selection if c not in used]
        placed = ", ".join(f"{w.name} on {gpu_names(w.cards)}" for w in self.workers)
        return placed + (f" ({gpu_names(idle)} idle)" if idle else "")


def cards_text(count: int) -> str:
    return f"{count} card{'s' * (count != 1)}"


def gpu_names(cards: Sequence[int]) -> str:
    """'GPU 0', 'GPUs 2,3'."""
    return f"GPU{'s' * (len(cards) > 1)} {','.join(str(c) for c in cards)}"


def place_workers(selection: tuple[int, ...], workers: Sequence[tuple[str, int]]) -> Placement:
    """`workers` ((name, ranks), in start order) on the `selection`'s cards: the next `ranks`
    cards each, or all on the first ones when there are too few (`shared`). `UsageError` when
    one worker has more ranks than the selection has cards."""
    for name, ranks in workers:
        if ranks > len(selection):
            raise UsageError(f"--gpus: {name} has {ranks} ranks, a card each, but --gpus gives "
                             f"{cards_text(len(selection))}")  # fmt: skip
    if sum(ranks for _, ranks in workers) > len(selection):
        shared = tuple(WorkerCards(name, t, selection[:t]) for name, t in workers)
        return Placement(shared, selection, shared=True)
    placed, start = [], 0
    for name, ranks in workers:
        placed.append(WorkerCards(name, ranks, selection[start : start + ranks]))
        start += ranks
    return Placement(tuple(placed), selection)


def visible_devices(cards: Sequence[int], launcher_visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for a worker on `cards` (the launcher's indices): the launcher's own
    entries at those positions when it has a CUDA_VISIBLE_DEVICES (ids or UUIDs), else the
    indices themselves."""
    if launcher_visible is None:
        return ",".join(str(c) for c in cards)
    entries = [e.strip() for e in launcher_visible.split(",")]
    return ",".join(entries[c] for c in cards)


# In a child process: the launcher itself never opens a CUDA context (it would hold device
# memory for as long as the cluster runs).
_PROBE = (
    "import torch; c = torch.cuda; n = c.device_count() if c.is_available() else 0;"
    " print(*(c.get_device_properties(i).total_memory for i in range(n)))"
)


def cuda_cards() -> tuple[int, ...]:
    """Total memory of each CUDA card the workers can see, in CUDA's order (the launcher's
    CUDA_VISIBLE_DEVICES applies); () without any."""
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    try:
        return tuple(int(total) for total in done.stdout.strip().splitlines()[-1].split())
    except (ValueError, IndexError):
        return ()
