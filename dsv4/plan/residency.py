"""Which routed experts stay on the device when K per MoE layer are offloaded: a residency file.

The worker counts routed selections per (MoE layer, expert) (`dsv4.runner.routing_stats`,
`metrics.routing_stats`) and dumps them as a `Residency` with every expert resident;
`dsv4 plan --routing-stats F --residency-out R` keeps the plan's E - K most-used experts of
each layer (the plan decides how many, the counts which) and writes R for the offload pool,
which reads `order[layer][:num_resident]` as the layer's hot experts.

The file is JSON, versioned (`RESIDENCY_VERSION`), and names the model it was counted on by
its MoE layer count (the MTP layer included, last) and routed experts per layer; a file of
another version or shape is refused with one line (`ResidencyError`). Pure Python: no torch.

    {"version": 1, "num_layers": L, "num_experts": E, "num_resident": R,
     "order": [[e, ...] * L], "counts": [[n, ...] * L]}
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from dsv4.errors import Dsv4Error

RESIDENCY_VERSION = 1


class ResidencyError(Dsv4Error):
    """A residency / routing-stats file is missing, not ours, or for another model shape."""

    grpc_code = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class Residency:
    version: int
    num_layers: int  # MoE layers counted: the main layers, then the MTP layer if any
    num_experts: int  # routed experts per layer
    num_resident: int  # experts per layer kept on the device: order[layer][:num_resident]
    order: tuple[tuple[int, ...], ...]  # [L][E] expert ids, most selected first (ties: id)
    counts: tuple[tuple[int, ...], ...]  # [L][E] selections of expert e in layer l

    @classmethod
    def from_counts(cls, counts: list[list[int]], num_resident: int | None = None) -> Residency:
        """Counts [L][E] -> the order they imply; `num_resident` None: every expert."""
        rows = tuple(tuple(int(n) for n in row) for row in counts)
        e = len(rows[0]) if rows else 0
        order = tuple(tuple(sorted(range(e), key=lambda x, r=row: (-r[x], x))) for row in rows)
        r = Residency(RESIDENCY_VERSION, len(rows), e, e if num_resident is None else num_resident,
                      order, rows)  # fmt: skip
        r.check()
        return r

    def with_resident(self, num_resident: int) -> Residency:
        """The same counts with `num_resident` experts per layer kept on the device."""
        return Residency.from_counts([list(c) for c in self.counts], num_resident)

    def resident(self, layer: int) -> tuple[int, ...]:
        """Layer's experts kept on the device, most used first."""
        return self.order[layer][: self.num_resident]

    def resident_share(self) -> float:
        """Fraction of all counted selections that hit a resident expert."""
        total = sum(sum(row) for row in self.counts)
        hits = sum(self.counts[i][e] for i in range(self.num_layers) for e in self.resident(i))
        return hits / total if total else 0.0

    def check(self, num_layers: int | None = None, num_experts: int | None = None) -> None:
        """Raise `ResidencyError` unless well formed (and of this model shape when given)."""
        if self.version != RESIDENCY_VERSION:
            raise ResidencyError(f"version {self.version}, this build reads version "
                                 f"{RESIDENCY_VERSION}: dump the routing stats again")  # fmt: skip
        for name, want in (("num_layers", num_layers), ("num_experts", num_experts)):
            have = getattr(self, name)
            if want is not None and have != want:
                raise ResidencyError(f"{name} {have}, the model has {want}: counted on "
                                     "another model")  # fmt: skip
        e = self.num_experts
        if len(self.counts) != self.num_layers or len(self.order) != self.num_layers:
            raise ResidencyError(f"{self.num_layers} layers declared, rows for fewer or more")
        if any(len(c) != e or any(n < 0 for n in c) for c in self.counts):
            raise ResidencyError(f"each counts row must hold {e} non-negative counts")
        if any(sorted(o) != list(range(e)) for o in self.order):
            raise ResidencyError(f"each order row must list experts 0..{e - 1} once")
        if not 0 <= self.num_resident <= e:
            raise ResidencyError(f"num_resident {self.num_resident} not in 0..{e}")

    def to_json(self) -> str:
        body = {"version": self.version, "num_layers": self.num_layers,
                "num_experts": self.num_experts, "num_resident": self.num_resident,
                "order": [list(o) for o in self.order],
                "counts": [list(c) for c in self.counts]}  # fmt: skip
        return json.dumps(body, separators=(",", ":"))


_FIELDS = ("version", "num_layers", "num_experts", "num_resident", "order", "counts")


def parse_residency(text: str) -> Residency:
    """JSON text -> a checked `Residency` (`ResidencyError` when it is not one)."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ResidencyError(f"not JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ResidencyError("not a residency file: expected a JSON object")
    if raw.get("version") != RESIDENCY_VERSION:  # before the fields: another version may differ
        raise ResidencyError(f"version {raw.get('version')!r}, this build reads version "
                             f"{RESIDENCY_VERSION}: dump the routing stats again")  # fmt: skip
    missing = [f for f in _FIELDS if f not in raw]
    if missing:
        raise ResidencyError(f"not a residency file: no {', '.join(missing)}")
    try:
        r = Residency(*(int(raw[f]) for f in _FIELDS[:4]),
                      tuple(tuple(int(x) for x in row) for row in raw["order"]),
                      tuple(tuple(int(x) for x in row) for row in raw["counts"]))  # fmt: skip
    except (TypeError, ValueError) as exc:
        raise ResidencyError(f"not a residency file: {exc}") from exc
    r.check()
    return r


def read_residency(path: str | Path, num_layers: int | None = None,
                   num_experts: int | None = None) -> Residency:  # fmt: skip
    """The file at `path`, checked against the model shape when given."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ResidencyError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    try:
        r = parse_residency(text)
        r.check(num_layers, num_experts)
    except ResidencyError as exc:
        raise ResidencyError(f"{path}: {exc.message}") from exc
    return r


def write_residency(residency: Residency, path: str | Path) -> None:
    """Atomically (a reader never sees half a file): write beside, then rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(residency.to_json() + "\n")
    os.replace(tmp, path)
