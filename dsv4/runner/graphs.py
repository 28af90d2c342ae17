"""CUDA graphs for the decode forward, one per batch-size bucket (vLLM's capture sizes).

A decode step of B requests, each with q = 1 + k query positions (the last token and k
drafts), is padded to the smallest captured bucket >= B: its inputs are copied into that
bucket's static buffers and the bucket's graph is replayed. Everything a graph reads is a
fixed-shape device tensor rewritten in place each step (graph-safe metadata): token ids,
positions, block tables, ring block ids, sequence lengths and the request index of every row,
-1 for padding rows (kernels skip them, as vLLM's `token_to_req_indices`). Padding rows are
rewritten too, so nothing of an earlier, larger step leaks into a replay.

Steps with more requests than the largest bucket run eagerly (`run` returns None).

NOTE: only a graph-safe forward can be captured: fixed shapes, no host synchronisation, no
data-dependent allocation. The reference model of dsv4/model is NOT one (`int(positions[0])`,
`.tolist()` in the MoE dispatch, per-row Python loops, states grown with `torch.cat`), so the
`ModelRunner` does not capture it; `DecodeGraphs` wraps the paged GPU decode forward
(`DecodeFn`) once that exists. Only enabled on CUDA. Untested on a GPU so far.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


def capture_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8 up to `max_batch` (vLLM's default list)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return tuple(sorted(set(sizes)))


def bucket_for(num_requests: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket holding `num_requests` rows; None past the largest (run eager)."""
    for size in sizes:
        if size >= num_requests:
            return size
    return None


@dataclass
class DecodeInputs:
    """Graph-safe decode metadata for `bucket` rows of `query_len` positions (one device
    tensor per field, shapes fixed per bucket)."""

    token_ids: torch.Tensor  # [bucket, query_len] int64
    positions: torch.Tensor  # [bucket, query_len] int64
    block_tables: torch.Tensor  # [bucket, max_blocks] int32, -1 padded
    ring_block_ids: torch.Tensor  # [bucket, num_ring_blocks] int32
    seq_lens: torch.Tensor  # [bucket] int32: positions after this step (0: padding row)
    request_index: torch.Tensor  # [bucket] int32: row's request, -1 for padding rows

    @classmethod
    def empty(
        cls, bucket: int, query_len: int, max_blocks: int, num_ring_blocks: int, device
    ) -> DecodeInputs:
        def full(shape, value, dtype):
            return torch.full(shape, value, dtype=dtype, device=device)

        return cls(
            full((bucket, query_len), 0, torch.int64),
            full((bucket, query_len), 0, torch.int64),
            full((bucket, max_blocks), -1, torch.int32),
            full((bucket, num_ring_blocks), -1, torch.int32),
            full((bucket,), 0, torch.int32),
            full((bucket,), -1, torch.int32),
        )

    def copy_(self, other: DecodeInputs) -> None:
        for name in self.__dataclass_fields__:
            getattr(self, name).copy_(getattr(other, name), non_blocking=True)


def pad_decode_inputs(
    token_ids: Sequence[Sequence[int]],
    start_positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    ring_block_ids: Sequence[Sequence[int]],
    bucket: int,
    max_blocks: int,
    device: str | torch.device = "cpu",
) -> DecodeInputs:
    """The step's B rows padded to `bucket` rows (host-side build, one copy to the device)."""
    num_rows, query_len = len(token_ids), len(token_ids[0])
    if num_rows > bucket:
        raise ValueError(f"{num_rows} requests do not fit bucket {bucket}")
    num_ring = len(ring_block_ids[0])
    out = DecodeInputs.empty(bucket, query_len, max_blocks, num_ring, "cpu")
    steps = torch.arange(query_len)
    for row in range(num_rows):
        table = block_tables[row]
        if len(table) > max_blocks:
            raise ValueError(f"block table of {len(table)} blocks > max_blocks {max_blocks}")
        out.token_ids[row] = torch.tensor(token_ids[row])
        out.positions[row] = start_positions[row] + steps
        out.block_tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
        out.ring_block_ids[row] = torch.tensor(ring_block_ids[row], dtype=torch.int32)
        out.seq_lens[row] = start_positions[row] + query_len
        out.request_index[row] = row
    if torch.device(device).type == "cpu":
        return out
    moved = DecodeInputs.empty(bucket, query_len, max_blocks, num_ring, device)
    moved.copy_(out)
    return moved


DecodeFn = Callable[[DecodeInputs], torch.Tensor]  # static inputs -> logits [bucket, q, V]


class DecodeGraphs:
    """Captured decode graphs per bucket; `run` replays the right one (engine thread only)."""

    def __init__(
        self,
        fn: DecodeFn,
        *,
        sizes: Sequence[int],
        query_len: int,
        max_blocks: int,
        num_ring_blocks: int,
        device: torch.device | str,
    ) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; run the decode forward eagerly")
        self.fn, self.sizes, self.query_len = fn, tuple(sorted(sizes)), query_len
        self.max_blocks, self.num_ring_blocks = max_blocks, num_ring_blocks
        self.inputs: dict[int, DecodeInputs] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def capture(self, num_warmup: int = 2) -> None:
        """Capture every bucket, largest first, all sharing one memory pool. The static
        inputs hold padding rows only, which a graph-safe `fn` must accept."""
        for size in sorted(self.sizes, reverse=True):
            inputs = DecodeInputs.empty(
                size, self.query_len, self.max_blocks, self.num_ring_blocks, self.device
            )
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: lazy inits and autotuning off-graph
                for _ in range(num_warmup):
                    self.fn(inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                output = self.fn(inputs)
            self.pool = graph.pool() if self.pool is None else self.pool
            self.inputs[size], self.outputs[size], self.graphs[size] = inputs, output, graph
        torch.cuda.synchronize(self.device)

    def run(
        self,
        token_ids: Sequence[Sequence[int]],
        start_positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        ring_block_ids: Sequence[Sequence[int]],
    ) -> torch.Tensor | None:
        """Replay for B rows -> logits [B, q, V] (a view of the static output: consume it
        before the next `run`), or None when B exceeds the largest bucket."""
        bucket = bucket_for(len(token_ids), self.sizes)
        if bucket is None or bucket not in self.graphs:
            return None
        padded = pad_decode_inputs(
            token_ids, start_positions, block_tables, ring_block_ids, bucket, self.max_blocks
        )
        self.inputs[bucket].copy_(padded)
        self.graphs[bucket].replay()
        return self.outputs[bucket][: len(token_ids)]
