"""Scheduling policies as pure functions: prefill chunk planning, decode-first ordering and
preemption choice, and the speculative token reservation. `Scheduler` calls them each step;
tests and benchmarks call them directly.

Prefill chunk planning (vLLM #45061). Sparse prefill attention gathers, per request, its
visible compressed entries (N = seq_len // r) and its raw window prefix plus the chunk's own
tokens (gather = query_len + min(prefix_len, window - 1)) into a bf16 workspace of M = N +
gather rows (docs/model.md#prefill-workspaces). Requests run in chunks of consecutive requests:
- "area" (default): pack greedily while num_requests * (max N + max gather) stays within an
  area budget computed from the real lengths of the step;
- "fixed" (baseline): `group_size` requests per chunk, each sized for the worst case
  (N = ceil(max_model_len / r), gather = window + max_num_batched_tokens).
Both keep the same area budget: group_size * worst-case width.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dsv4.scheduler.batch import PrefillChunk

if TYPE_CHECKING:
    from dsv4.scheduler.request import Request

CHUNK_PLAN_MODES = ("area", "fixed")
SPEC_BUDGET_MODES = ("adaptive", "static")


@dataclass(frozen=True)
class PrefillShape:
    """One prefill request of the step: `prefix_len` tokens cached, `query_len` computed now."""

    prefix_len: int
    query_len: int

    @property
    def seq_len(self) -> int:
        return self.prefix_len + self.query_len


def compressed_len(seq_len: int, ratio: int) -> int:
    """Compressed entries visible to the last query of a `seq_len` sequence (0 for SWA)."""
    return seq_len // ratio if ratio else 0


def gather_len(shape: PrefillShape, window: int) -> int:
    """Raw rows a prefill request gathers: its queries plus the window prefix before them."""
    return shape.query_len + min(shape.prefix_len, window - 1)


def worst_case_width_rows(
    ratio: int, *, max_model_len: int, window: int, max_num_batched_tokens: int
) -> int:
    """Workspace rows per request when sized by max context (the fixed planner's M)."""
    compressed = math.ceil(max_model_len / ratio) if ratio else 0
    return compressed + window + max_num_batched_tokens


def plan_prefill_chunks_by_area(
    shapes: Sequence[PrefillShape], ratio: int, *, window: int, area_budget_rows: int
) -> tuple[PrefillChunk, ...]:
    """Greedy packing of consecutive requests while `count * (max N + max gather)` fits the
    budget; a request that alone exceeds it gets a chunk of its own."""
    chunks: list[PrefillChunk] = []
    start, max_n, max_g = 0, 0, 0
    for index, shape in enumerate(shapes):
        n, g = compressed_len(shape.seq_len, ratio), gather_len(shape, window)
        grown_n, grown_g = max(max_n, n), max(max_g, g)
        if index > start and (index - start + 1) * (grown_n + grown_g) > area_budget_rows:
            chunks.append(PrefillChunk(start, index, max_n, max_g))
            start, grown_n, grown_g = index, n, g
        max_n, max_g = grown_n, grown_g
    if len(shapes) > start:
        chunks.append(PrefillChunk(start, len(shapes), max_n, max_g))
    return tuple(chunks)


def plan_prefill_chunks_fixed(
    num_prefills: int,
    ratio: int,
    *,
    group_size: int,
    max_model_len: int,
    window: int,
    max_num_batched_tokens: int,
) -> tuple[PrefillChunk, ...]:
    """The baseline: `group_size` requests per chunk, workspace sized by max context."""
    n = math.ceil(max_model_len / ratio) if ratio else 0
    gather = window + max_num_batched_tokens
    return tuple(
        PrefillChunk(start, min(start + group_size, num_prefills), n, gather)
        for start in range(0, num_prefills, group_size)
    )


def plan_prefill_chunks(
    shapes: Sequence[PrefillShape],
    ratio: int,
    *,
    mode: str,
    group_size: int,
    max_model_len: int,
    window: int,
    max_num_batched_tokens: int,
    area_budget_rows: int = 0,
) -> tuple[PrefillChunk, ...]:
    """Dispatch on `mode` ("area" | "fixed"). The area planner's budget is
    `area_budget_rows`, or when 0 the fixed planner's area (group_size * worst-case width)."""
    if mode == "fixed":
        return plan_prefill_chunks_fixed(
            len(shapes),
            ratio,
            group_size=group_size,
            max_model_len=max_model_len,
            window=window,
            max_num_batched_tokens=max_num_batched_tokens,
        )
    if mode != "area":
        raise ValueError(f"prefill chunk plan {mode!r}: choose one of {CHUNK_PLAN_MODES}")
    width = worst_case_width_rows(
        ratio,
        max_model_len=max_model_len,
        window=window,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    budget = area_budget_rows or group_size * width
    return plan_prefill_chunks_by_area(shapes, ratio, window=window, area_budget_rows=budget)


def spec_token_reservation(num_running: int, k: int, max_num_seqs: int, mode: str) -> int:
    """Token budget held back for the `k` draft tokens of each decoding request (#51725).

    "adaptive": only for requests actually running, so a lone long prompt gets (almost) the
    whole prefill budget; "static" (baseline): for `max_num_seqs` requests whatever runs.
    """
    if mode not in SPEC_BUDGET_MODES:
        raise ValueError(f"spec budget {mode!r}: choose one of {SPEC_BUDGET_MODES}")
    if k <= 0:
        return 0
    if mode == "static":
        return k * max_num_seqs
    return k * min(num_running, max_num_seqs)


def service_order_key(request: Request) -> tuple[int, float, int]:
    """Who is served first (and preempted last): priority, then arrival. A total order, so
    of two requests short of blocks one can always preempt the other (no deadlock)."""
    return (request.priority, request.arrival_time_s, request.arrival_seq)


def decode_first_order(requests: Iterable[Request]) -> list[Request]:
    """Running requests in the order the step serves them: all decodes, then prefills, each
    by priority and arrival. Decodes first keeps TPOT steady under prefill load."""
    ordered = sorted(requests, key=service_order_key)
    return [r for r in ordered if r.is_decoding] + [r for r in ordered if not r.is_decoding]


def pick_preemption_victim(candidates: Iterable[Request]) -> Request | None:
    """The request to preempt by recompute: lowest priority, latest arrival."""
    return max(candidates, key=service_order_key, default=None)
