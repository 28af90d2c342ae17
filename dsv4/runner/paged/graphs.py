"""CUDA graphs of the paged decode step: one per (pass, batch bucket, context bucket).

A decode-only step of B requests, each with q tokens (the last token, plus k drafts when MTP
verifies them), is padded to the smallest captured batch bucket >= B and to the smallest
context bucket >= its longest sequence. Its host facts (ids, positions, block tables, ring
blocks) go into ONE pinned staging tensor, one copy puts them on the device, the graph replays.
Three passes are captured (`PASSES`): the target model over q = 1 + k tokens, and the MTP
layer over q = 1 + k (the verified positions of a step) and over q = 1 (one draft step).

What makes a step capturable (`PagedForward.run` on `StepShape.static_decode`):
- every input is a fixed-shape slice of one packed device buffer rewritten in place (MTP
  passes also read a static streams buffer);
- host decisions read only the bucket: the compressor launches a program per token (non-
  boundary ones exit at once), the indexer width and the C128 table come from the context
  bucket, and a context bucket of at most 4 * index_topk entries takes the select-all path
  (#49486 survives capture: vLLM turns it off there);
- padding rows are requests of their own whose blocks are the cache's scratch blocks
  (`PagedKVCache.scratch_block_ids`): what they compute lands where nothing reads.

`capture=False` runs the same static step eagerly instead of replaying a graph: on CPU that
checks that a step depends on nothing but its static buffers (the tests), and it is the
step's cost without graphs in benchmarks.
"""

from __future__ import annotations

import gc
import itertools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from dsv4.runner.paged.step_metadata import StepShape, StepTensors

logger = logging.getLogger(__name__)

PASSES = ("target", "mtp", "mtp_draft")  # mtp: q = 1 + k verified positions; mtp_draft: q = 1


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8 up to `max_batch` (vLLM's capture sizes)."""
    sizes = {s for s in (1, 2, 4) if s < max_batch} | set(range(8, max_batch + 1, 8))
    return tuple(sorted(sizes | {max_batch}))


def context_buckets(max_len: int, index_topk: int) -> tuple[int, ...]:
    """4 * index_topk (the longest context whose C4 top-k is "everything"), then x4 steps up to
    `max_len`: a step's tables and indexer width are sized by its bucket, not by max_len. A
    step just under max_len would gain nothing from a bucket of its own: max_len absorbs it."""
    first = 4 * index_topk
    sizes = []
    while first * 2 <= max_len:
        sizes.append(first)
        first *= 4
    return (*sizes, max_len)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collected now, then the automatic collector off until the block
    ends: what `StaticPass.capture` warms up and captures in.

    Why: the collector runs at whichever allocation crosses its threshold, and the finalizers
    of what it frees run right there. Cyclic garbage can hold CUDA resources whose finalizers
    call the driver: a dropped expert pool (`LayerPool.owner_pool` <-> `ExpertPool.layers`)
    its registered host rows, whose `weakref.finalize` calls cudaHostUnregister
    (`host_blobs`), a dropped engine core its CUDA graphs. Inside a global-mode capture such a
    call is refused, the finalizer drops the error, and the capture is invalidated: the next
    launch, wherever it is, fails with "operation failed due to a previous error during
    capture" (most likely the pooled halves128 GPU test's failure at `copy_wait_end`, after
    the earlier cases had dropped their pools). `torch.cuda.graph` does not
    collect on entry by default (torch.compiler.config.force_cudagraph_gc). One collection a
    pass, not one a key: a full collection of a large process is not free, and a pass has up
    to ~80 keys."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def bucket_of(value: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= value; None past the largest."""
    for size in buckets:
        if size >= value:
            return size
    return None


@dataclass(frozen=True)
class StepRow:
    """One real request of a static step."""

    token_ids: tuple[int, ...]  # q tokens at positions start..start+q-1
    start: int
    block_table: tuple[int, ...]
    ring_block_ids: tuple[int, ...]
    select: int = -1  # which of the q tokens an MTP pass computes logits for (-1: the last)
    # async scheduling: the row of the previous step whose greedy token (still on the device)
    # is this row's token; -1: `token_ids` as given
    prev_row: int = -1


class StaticInputs:
    """The packed int64 device buffer of a pass's step tensors, laid out for the largest bucket
    (a bucket reads each field's prefix), its pinned host twin and the all-padding template."""

    FIELDS = ("token_ids", "positions", "token_to_req", "query_start_loc", "block_tables",
              "ring_ids", "starts", "ends", "select", "prev_rows")  # fmt: skip
    # held as int32 pairs in the int64 words (the readers' dtype: no cast launch a replay)
    INT32 = frozenset(("token_to_req", "query_start_loc", "block_tables"))

    def __init__(self, max_batch: int, query_len: int, max_blocks: int,
                 scratch_blocks: Sequence[int], num_ring_blocks: int,
                 device: torch.device) -> None:  # fmt: skip
        b, q, nb, nr = max_batch, query_len, max_blocks, num_ring_blocks
        self.max_batch, self.query_len, self.max_blocks, self.num_ring = b, q, nb, nr
        counts = (b * q, b * q, b * q, b + 1, b * nb, b * nr, b, b, b, b)  # elements
        self.counts = dict(zip(self.FIELDS, counts))
        # int64 words a field takes, even: every field starts 16-byte aligned, as a fresh
        # allocation does (Triton specialises its pointers on that)
        sizes = [
            2 * math.ceil(n / (4 if f in self.INT32 else 2)) for f, n in zip(self.FIELDS, counts)
        ]
        self.offsets = dict(zip(self.FIELDS, itertools.accumulate((0, *sizes))))
        total = sum(sizes)
        pin = device.type == "cuda"
        self.host = torch.zeros(total, dtype=torch.int64, pin_memory=pin)
        self.dev = torch.zeros(total, dtype=torch.int64, device=device)
        self.copied = torch.cuda.Event() if pin else None
        # Padding: row i is request i at positions 0..q-1 on the scratch blocks.
        token_block, rings = scratch_blocks[0], scratch_blocks[1 : 1 + nr]
        assert len(rings) == nr, "scratch blocks: one token block + the ring blocks"
        self.scratch_token_block = token_block
        t = np.zeros(total, dtype=np.int64)
        rows = np.arange(b)
        self._field(t, "positions")[:] = np.tile(np.arange(q), b)
        self._field(t, "token_to_req")[:] = np.repeat(rows, q)
        self._field(t, "query_start_loc")[:] = np.arange(b + 1) * q
        self._field(t, "block_tables")[:] = token_block
        self._field(t, "ring_ids")[:] = np.tile(np.asarray(rings, dtype=np.int64), b)
        self._field(t, "ends")[:] = q
        self._field(t, "select")[:] = rows * q + q - 1
        self.template = t

    def _field(self, flat: np.ndarray, name: str) -> np.ndarray:
        """The field's elements in the int64 host array `flat` (a view: writes land there)."""
        i = self.FIELDS.index(name)
        lo = self.offsets[name]
        hi = self.offsets[self.FIELDS[i + 1]] if i + 1 < len(self.FIELDS) else len(flat)
        words = flat[lo:hi]
        return (words.view(np.int32) if name in self.INT32 else words)[: self.counts[name]]

    def _dev(self, name: str, n: int) -> torch.Tensor:
        """The first n elements of the field in the device buffer (a view)."""
        lo = self.offsets[name]
        if name in self.INT32:
            return self.dev[lo : lo + math.ceil(n / 2)].view(torch.int32)[:n]
        return self.dev[lo : lo + n]

    def write(self, rows: Sequence[StepRow], padding_start: int = 0) -> None:
        """Host: the template, then the real rows; one copy to the device (in stream order).
        `padding_start` > 0 puts padding rows at positions padding_start.. (the warm-up runs
        them at a full context, so the autotuner sees real work)."""
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has left the pinned buffer
        flat = self.host.numpy()
        np.copyto(flat, self.template)
        q, nb = self.query_len, self.max_blocks
        ids, pos = self._field(flat, "token_ids"), self._field(flat, "positions")
        tables = self._field(flat, "block_tables").reshape(self.max_batch, nb)
        rings = self._field(flat, "ring_ids").reshape(self.max_batch, self.num_ring)
        starts, ends = self._field(flat, "starts"), self._field(flat, "ends")
        select, prev_rows = self._field(flat, "select"), self._field(flat, "prev_rows")
        if padding_start:
            pos += padding_start
            starts[:] = padding_start
            ends[:] = padding_start + q
        for i, row in enumerate(rows):
            assert len(row.token_ids) == q and len(row.block_table) <= nb
            ids[i * q : (i + 1) * q] = row.token_ids
            pos[i * q : (i + 1) * q] = np.arange(row.start, row.start + q)
            tables[i, : len(row.block_table)] = row.block_table
            rings[i] = row.ring_block_ids
            starts[i], ends[i] = row.start, row.start + q
            select[i] = i * q + (row.select % q)
            prev_rows[i] = row.prev_row
        self.dev.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def tensors(self, batch: int) -> tuple[StepTensors, torch.Tensor]:
        """Views of the device buffer for a bucket, in their readers' dtypes (no launch): the
        step tensors and `select` [batch] int64, the flat row each MTP row reports."""
        q, nb, nr = self.query_len, self.max_blocks, self.num_ring
        n, f = batch * q, self._dev
        return StepTensors(
            token_ids=f("token_ids", n), positions=f("positions", n),
            token_to_req=f("token_to_req", n), query_start_loc=f("query_start_loc", batch + 1),
            block_tables=f("block_tables", batch * nb).view(batch, nb),
            ring_ids=f("ring_ids", batch * nr).view(batch, nr),
            starts=f("starts", batch), ends=f("ends", batch),
        ), f("select", batch)  # fmt: skip

    def feed_tokens(self, batch: int, previous: torch.Tensor) -> None:
        """Device side, in stream order after `write`'s copy: token_ids[i] = previous[
        prev_rows[i]] for the first `batch` rows (q = 1; every row has a previous row).
        `previous` [>= max prev_row + 1] int64: the last step's greedy tokens, never on the
        host (async scheduling)."""
        assert self.query_len == 1
        rows = self._dev("prev_rows", batch)
        self._dev("token_ids", batch).copy_(previous.index_select(0, rows))


# (shape, step tensors, select [B], streams [T, M, D] or None) -> outputs (tensors)
StepFn = Callable[[StepShape, StepTensors, torch.Tensor, torch.Tensor | None],
                  tuple[torch.Tensor, ...]]  # fmt: skip


class StaticPass:
    """One pass's static inputs and its graphs (or eager static runs) per (batch, context)."""

    def __init__(self, fn: StepFn, inputs: StaticInputs, batches: Sequence[int],
                 contexts: Sequence[int], streams_shape: tuple[int, ...] | None,
                 dtype: torch.dtype, capture: bool) -> None:  # fmt: skip
        self.fn, self.inputs = fn, inputs
        self.batches, self.contexts = tuple(batches), tuple(contexts)
        self.capture_graphs = capture
        dev = inputs.dev.device
        rows = inputs.max_batch * inputs.query_len
        self.streams = (None if streams_shape is None
                        else torch.zeros(rows, *streams_shape, dtype=dtype, device=dev))  # fmt: skip
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.num_runs = 0  # steps served (metrics, tests)
        # Every key's graph writes its outputs into these (prefixes): one logits buffer per
        # pass, not one per (batch, context) key (~4 GB of logits at 128 x 4 buckets x q = 4).
        self.out_buffers: tuple[torch.Tensor, ...] = ()

    def key_for(self, num_requests: int, max_end: int) -> tuple[int, int] | None:
        batch = bucket_of(num_requests, self.batches)
        context = bucket_of(max_end, self.contexts)
        return None if batch is None or context is None else (batch, context)

    def _call(self, key: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        batch, context = key
        shape = StepShape.static_decode(batch, self.inputs.query_len, context)
        streams = None if self.streams is None else self.streams[: batch * self.inputs.query_len]
        tensors, select = self.inputs.tensors(batch)
        return self.fn(shape, tensors, select, streams)

    def capture(self, pool, warmup_context: bool = True) -> object:
        """Capture every key, largest first, into one shared memory pool (returned); with
        graphs, under `collector_paused` (no finalizer runs inside a capture)."""
        if not self.capture_graphs:
            return self._capture_keys(pool, warmup_context)
        with collector_paused():
            return self._capture_keys(pool, warmup_context)

    def _capture_keys(self, pool, warmup_context: bool) -> object:
        for key in sorted(itertools.product(self.batches, self.contexts), reverse=True):
            context = key[1]
            full = max(context - self.inputs.query_len, 0) if warmup_context else 0
            self.inputs.write((), padding_start=full)  # autotune on a full-context workload
            if not self.capture_graphs:
                self._call(key)
                continue
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    warm = self._call(key)
            torch.cuda.current_stream().wait_stream(side)
            if not self.out_buffers:  # the largest batch comes first: its outputs size them
                self.out_buffers = tuple(torch.empty_like(t) for t in warm)
            self.inputs.write(())  # captured with cheap padding rows (position 0)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = tuple(buf[: t.shape[0]].copy_(t)
                                          for buf, t in zip(self.out_buffers, self._call(key)))  # fmt: skip
            pool = graph.pool() if pool is None else pool
            self.graphs[key] = graph
        return pool

    def run(self, key: tuple[int, int], rows: Sequence[StepRow],
            streams: torch.Tensor | None = None,
            previous: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """Outputs for the bucket's rows (views of static tensors on the GPU: consume them
        before the next run of this pass). `streams` [len(rows) * q, M, D] for MTP passes;
        `previous`: the tokens the rows' `prev_row`s index (`StaticInputs.feed_tokens`)."""
        self.num_runs += 1
        self.inputs.write(rows)
        if previous is not None:
            self.inputs.feed_tokens(len(rows), previous)
        if streams is not None:
            assert self.streams is not None
            self.streams[: streams.shape[0]].copy_(streams)
        if not self.capture_graphs:
            return self._call(key)
        self.graphs[key].replay()
        return self.outputs[key]


def graph_max_end(max_model_len: int, query_len: int) -> int:
    """The largest `start + q` a decode step can have (drafts may run past max_model_len)."""
    return max_model_len + query_len


def max_blocks_for(max_end: int, block_size: int) -> int:
    return math.ceil(max_end / block_size)
