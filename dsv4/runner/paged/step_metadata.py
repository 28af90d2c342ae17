"""One engine step as flat device tensors, and the sparse-index metadata its layers share.

The paged forward runs every token of a step in one flat batch [T] (decode tokens first, then
the prefill chunks, as `ScheduledBatch` orders requests). Host-known facts (positions, lengths,
block tables) cross to the device in ONE packed copy, with the per-step tables an eager step
can build on the host (window bases per request, C4 lengths, the local block table: numpy, no
device launches); the rest is built on the device once per step (`StepMetadata`; a captured
decode step builds them all there, inside its graph) and reused by every layer of a kind (#45863):
- `win_slots` [T_d, W]: ring-relative window slots (p' % R) of each decode token's window
  positions max(0, p-W+1)..p, -1 padded; a layer adds its ring page base per token;
- `c128_slots` [T_d, N]: every visible ratio-128 entry as `block * SPB + i % E`; a layer adds
  its page offset (comp_base) at the kernel;
- `win_base` [L, T]: each layer's ring page base of every token's request (KV slots);
- `c4_lens` [T]: visible ratio-4 entries (p + 1) // 4 per token;
- `win_rel` [T]: each token's slot in the window ring (the window store's);
a captured step builds the last three in one launch (`kernels.step_tables.window_tables`).
With `shared` off (#45863's baseline) the tables are rebuilt for every layer that reads them;
with `cached_token_to_req` off (#47474's baseline) every builder rebuilds token->request on the
host and copies it over.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dsv4.runner.paged.geometry import CacheGeometry
from dsv4.scheduler.batch import ScheduledRequest
from kernels import metadata as builders
from kernels.backend import KernelBackendConfig, resolve


@dataclass(frozen=True)
class StepShape:
    """What a step's layers may know on the host: counts and bounds, never device values.

    An eager step knows its exact positions (`host_positions`); a captured decode step knows
    only its bucket, so every host decision that would read positions takes the bound
    instead: the compressor launches a program per token (non-boundary ones idle), the
    indexer's width and the C128 table come from `max_end`, and every row samples."""

    num_tokens: int
    num_decode_tokens: int
    num_decode_requests: int
    num_prefill_requests: int
    max_end: int  # > every position of the step (exact, or the captured context bucket)
    host_positions: tuple[int, ...] | None  # None: not known on the host (captured step)
    sample_rows: tuple[int, ...] | None  # flat rows that sample; None: every row

    @classmethod
    def static_decode(cls, num_requests: int, query_len: int, max_end: int) -> StepShape:
        """A captured decode step: `num_requests` rows of `query_len` tokens, ends <= max_end."""
        n = num_requests * query_len
        return cls(n, n, num_requests, 0, max_end, None, None)

    def max_position_plus_one(self, lo: int, hi: int) -> int:
        """1 + the largest position of flat tokens [lo, hi) (a bound when not on the host)."""
        if self.host_positions is None:
            return self.max_end
        return max(self.host_positions[lo:hi]) + 1


@dataclass(frozen=True)
class StepTokens:
    """Host view of a step (what the scheduler decided)."""

    requests: tuple[ScheduledRequest, ...]
    num_decode_requests: int
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    first_token: tuple[int, ...]  # index of each request's first token in the flat batch
    # flat rows whose logits are sampled: the last token of each sampling request, and every
    # position of a decode with drafts (verification samples each of its 1 + k positions)
    sample_rows: tuple[int, ...]

    @classmethod
    def of(cls, requests: tuple[ScheduledRequest, ...]) -> StepTokens:
        lens = [r.num_tokens + r.num_draft_tokens for r in requests]
        firsts = [0, *itertools.accumulate(lens)][:-1]
        decodes = sum(1 for r in requests if not r.is_prefill)
        assert all(r.is_prefill for r in requests[decodes:]), "decodes must come first"
        samples = tuple(itertools.chain.from_iterable(
            range(f + n - 1 - r.num_draft_tokens, f + n)
            for r, f, n in zip(requests, firsts, lens) if r.samples_token
        ))  # fmt: skip
        starts = tuple(r.start_position for r in requests)
        ends = tuple(s + n for s, n in zip(starts, lens))
        return cls(requests, decodes, starts, ends, tuple(firsts), samples)

    @property
    def num_tokens(self) -> int:
        return self.ends[-1] - self.starts[-1] + self.first_token[-1] if self.requests else 0

    @property
    def num_decode_tokens(self) -> int:
        d = self.num_decode_requests
        return self.first_token[d] if d < len(self.requests) else self.num_tokens

    @property
    def max_end(self) -> int:
        return max(self.ends, default=0)

    def request_of_tokens(self) -> list[int]:
        out: list[int] = []
        for b, (s, e) in enumerate(zip(self.starts, self.ends)):
            out.extend([b] * (e - s))
        return out

    @functools.cached_property
    def host_positions(self) -> tuple[int, ...]:
        """Every token's position (computed once per step; upload, compressor, indexer)."""
        return tuple(itertools.chain.from_iterable(map(range, self.starts, self.ends)))

    @functools.cached_property
    def shape(self) -> StepShape:
        d = self.num_decode_requests
        return StepShape(self.num_tokens, self.num_decode_tokens, d, len(self.requests) - d,
                         self.max_end, self.host_positions, self.sample_rows)  # fmt: skip


@dataclass(frozen=True)
class StepTensors:
    """Device tensors of a step (one packed host->device copy).

    The last three are built on the host by an eager step's `upload` (in the same copy);
    None for the captured decode passes (graphs.py), whose `StepMetadata` derives them from
    the static buffers on the device inside the graph."""

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    token_to_req: torch.Tensor  # [T] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    block_tables: torch.Tensor  # [B, nb] int32 token blocks, 0 padded
    ring_ids: torch.Tensor  # [B, num_ring_blocks] int64
    starts: torch.Tensor  # [B] int64: each request's first position this step
    ends: torch.Tensor  # [B] int64: one past each request's last position this step
    req_win_base: torch.Tensor | None = None  # [L, B] int32: each layer's ring page base
    c4_lens: torch.Tensor | None = None  # [T] int32: (p + 1) // 4
    local_block_table: torch.Tensor | None = None  # [B, nb] int32: rows 0..nb-1
    win_rel: torch.Tensor | None = None  # [T] int32: p % R, -1 if a later token takes the slot


def upload(tokens: StepTokens, token_ids: list[int], device: torch.device,
           geo: CacheGeometry | None = None) -> StepTensors:  # fmt: skip
    """The step's tensors in ONE upload (`upload_packed`), each in the dtype its readers take
    (no device casts). With `geo` the per-request window bases, C4 lengths, the local block
    table and the window store's ring slots cross too (host numpy instead of ~16 small device
    launches a step)."""
    reqs = tokens.requests
    num_b = len(reqs)
    nb = max([len(r.block_table) for r in reqs] + [1])
    nr = len(reqs[0].ring_block_ids) if reqs else 0
    tables = np.zeros((num_b, nb), dtype=np.int32)  # [B, nb] 0 padded
    for b, r in enumerate(reqs):
        tables[b, : len(r.block_table)] = r.block_table
    rings = np.asarray([r.ring_block_ids for r in reqs], dtype=np.int64).reshape(num_b, nr)
    starts = np.asarray(tokens.starts, dtype=np.int64)  # [B]
    ends = np.asarray(tokens.ends, dtype=np.int64)  # [B]
    t2r, idx = ragged(ends - starts)  # [T] flat tokens request-major, as the scheduler orders
    positions = starts[t2r] + idx  # [T] int64
    qsl = np.zeros(num_b + 1, dtype=np.int32)  # [B + 1] each request's first flat token
    qsl[1:] = np.cumsum(ends - starts)
    arrays = [np.asarray(token_ids, dtype=np.int64), positions, t2r.astype(np.int32), qsl,
              tables, rings, starts, ends]  # fmt: skip
    if geo is not None:
        rbi, base = geo.window_pages_host()  # [L] int64 each
        win = (rings[:, rbi] * geo.slots_per_block + base).T if num_b else rings[:, :0].T
        ring = geo.layers[0].window.slots
        win_rel = np.where(positions >= ends[t2r] - ring, positions % ring, -1)  # [T]
        arrays += [np.ascontiguousarray(win.reshape(len(rbi), num_b).astype(np.int32)),
                   ((positions + 1) // 4).astype(np.int32),
                   np.ascontiguousarray(np.broadcast_to(np.arange(nb, dtype=np.int32),
                                                        (num_b, nb))),
                   win_rel.astype(np.int32)]  # fmt: skip
    return StepTensors(*upload_packed(arrays, device))


_ALIGN = 16  # bytes: every uploaded table starts 16-aligned, as a fresh allocation (Triton)


def upload_packed(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """C-contiguous host arrays (int64, int32, fp32; any shapes) -> their device twins as views
    of ONE non-blocking upload (pageable, as `upload`), each `_ALIGN`-aligned.
    A few us of host time a table (two or three view ops and a numpy copy)."""
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    host = torch.empty(total, dtype=torch.uint8)  # [bytes]
    flat = host.numpy()
    for a, lo in zip(arrays, offsets):
        flat[lo : lo + a.nbytes] = a.reshape(-1).view(np.uint8)
    dev = host.to(device, non_blocking=True)
    typed: dict[np.dtype, torch.Tensor] = {}  # the whole upload viewed as each dtype
    out = []
    for a, lo in zip(arrays, offsets):
        if a.dtype not in typed:
            typed[a.dtype] = dev.view(_TORCH[a.dtype])
        first = lo // a.itemsize
        whole = typed[a.dtype][first : first + a.size]
        out.append(whole if a.ndim == 1 else whole.view(a.shape))
    return out


_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
          np.dtype(np.float32): torch.float32}  # fmt: skip


def ragged(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64 ([sum(counts)] the owner r of each item, [sum(counts)] its index < counts[r]),
    request-major: the order a row-major boolean mask over [R, max(counts)] selects in."""
    owner = np.repeat(np.arange(len(counts)), counts)
    start = np.cumsum(counts) - counts
    return owner, np.arange(len(owner)) - start[owner]


@dataclass(frozen=True)
class MetadataSwitches:
    shared: bool = True  # build once per step for all layers of a kind (#45863)
    cached_token_to_req: bool = True  # token->request once per step (#47474)
    skip_redundant_fill: bool = True  # no torch.full(-1) pre-fill of the tables (#50298)


@dataclass
class StepMetadata:
    """Sparse-index metadata of one step; `decode_candidates(ratio)` is what a layer reads.
    `tokens` is None for a captured decode step (its layers see only `shape`)."""

    shape: StepShape
    tokens: StepTokens | None
    t: StepTensors
    geo: CacheGeometry
    kernels: KernelBackendConfig
    switches: MetadataSwitches
    win_base: torch.Tensor = field(init=False)  # [L, T] int32
    c4_lens: torch.Tensor = field(init=False)  # [T] int32
    # [T] int32 each token's slot in the first layer's window ring (the window store's; -1: a
    # later token of the step takes it); None where the step's upload left it out
    win_rel: torch.Tensor | None = field(init=False)
    _shared: dict[int, torch.Tensor] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        geo, t = self.geo, self.t
        if t.req_win_base is not None and t.c4_lens is not None:  # host-built (eager `upload`)
            if t.req_win_base.shape[1] == 1 and self.shape.num_decode_tokens <= 1:
                # one prefill (or one decode token): every token's base is the request's, a
                # stride-0 view, no launch (readers index or cast it, never write; decode
                # rows would be copied contiguous per layer, so several take the gather)
                self.win_base = t.req_win_base.expand(-1, t.positions.shape[0])
            else:  # [L, B] -> [L, T]: one gather
                self.win_base = t.req_win_base.index_select(1, t.token_to_req)
            self.c4_lens, self.win_rel = t.c4_lens, t.win_rel
            return
        dev = t.positions.device  # a captured step: from the device tensors, one launch
        rbi, base = geo.window_pages(dev)
        self.win_base, self.c4_lens, self.win_rel = resolve("window_tables", self.kernels, dev)(
            t.positions,
            t.token_to_req,
            t.ends,
            t.ring_ids,
            rbi,
            base,
            slots_per_block=geo.slots_per_block,
            ring=geo.layers[0].window.slots,
        )

    @functools.cached_property
    def local_block_table(self) -> torch.Tensor:
        """[B, nb] int32 rows 0..nb-1: top-k through it yields local entry indices (prefill)."""
        if self.t.local_block_table is not None:
            return self.t.local_block_table
        bt = self.t.block_tables
        row = torch.arange(bt.shape[1], dtype=torch.int32, device=bt.device)
        return row.expand(bt.shape[0], -1).contiguous()

    # ---- decode candidate tables --------------------------------------------------------------
    def decode_candidates(self, ratio: int) -> torch.Tensor:
        """[T_d, W (+ N128)] int32 candidate table of the decode tokens for layers of `ratio`
        (C4 layers append their own top-k). Shared: one window table for every ratio (ratio 0's
        entry: its table is the window's), not one build per ratio kind (2 launches each)."""
        shared = self.switches.shared
        if shared and ratio in self._shared:
            return self._shared[ratio]
        table = self._shared.get(0) if shared else None
        if table is None:
            table = self._window_slots()
        if shared:
            self._shared[0] = table
        if ratio == 128:
            table = torch.cat((table, self._c128_slots()), dim=1)
        if self.switches.shared:
            self._shared[ratio] = table
        return table

    def _token_to_req(self, num_tokens: int) -> torch.Tensor:
        if self.switches.cached_token_to_req:
            return self.t.token_to_req[:num_tokens]
        qsl = self.t.query_start_loc[: self.shape.num_decode_requests + 1]
        return builders.token_to_req_indices_per_builder(qsl, num_tokens)

    def _window_slots(self) -> torch.Tensor:
        n = self.shape.num_decode_tokens
        geo = self.geo
        ring_slots = geo.layers[0].window.slots
        w = geo.layout.model.sliding_window
        dev = self.t.positions.device
        # Every logical ring "block" maps to page 0 of R slots: the table yields p % R.
        zero = torch.zeros(max(n, 1), math.ceil(max(self.shape.max_end, 1) / ring_slots),
                           dtype=torch.int32, device=dev)  # fmt: skip
        fn = self._builder("window_slot_table")
        slots, _ = fn(self.t.positions[:n], self._token_to_req(n), zero, w, ring_slots)
        return slots

    def _c128_slots(self) -> torch.Tensor:
        n = self.shape.num_decode_tokens
        geo = self.geo
        width = max(self.shape.max_end // 128, 1)
        epb = geo.layout.block_size // 128
        fn = self._builder("c128_index_table")
        slots, _ = fn(self.t.positions[:n], self._token_to_req(n), self.t.block_tables, width, epb,
                      128, slots_per_block=geo.slots_per_block)  # fmt: skip
        return slots

    def _builder(self, name: str):
        fn = resolve(name, self.kernels, self.t.positions.device)
        if fn is getattr(builders, name) and not self.switches.skip_redundant_fill:
            fn = getattr(builders, f"{name}_prefill")
        return fn
