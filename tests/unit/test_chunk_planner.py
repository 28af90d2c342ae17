"""Prefill chunk planning (#45061): docs/model.md#bookkeeping-example oracle, the PR's 10-request
example, and hypothesis invariants for the area and fixed planners."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.scheduler import PrefillChunk
from dsv4.scheduler.policy import (
    PrefillShape,
    compressed_len,
    gather_len,
    plan_prefill_chunks,
    plan_prefill_chunks_by_area,
    plan_prefill_chunks_fixed,
    worst_case_width_rows,
)

WINDOW = 128
A = PrefillShape(prefix_len=1000, query_len=512)  # positions 1000..1511
B = PrefillShape(prefix_len=0, query_len=300)


def test_worked_example_lengths() -> None:
    assert gather_len(A, WINDOW) == 639 and gather_len(B, WINDOW) == 300
    assert compressed_len(A.seq_len, 4) == 378 and compressed_len(B.seq_len, 4) == 75
    assert compressed_len(A.seq_len, 128) == 11 and compressed_len(B.seq_len, 128) == 2
    assert compressed_len(A.seq_len, 0) == 0


def test_worked_example_workspace_is_n_378_m_1017() -> None:
    (chunk,) = plan_prefill_chunks_by_area([A, B], 4, window=WINDOW, area_budget_rows=10_000)
    assert (chunk.start, chunk.end) == (0, 2)
    assert chunk.max_compressed_len == 378 and chunk.width_rows == 1017
    assert chunk.area_rows == 2 * 1017
    # A budget below 2 * 1017 splits them; each alone always gets a chunk.
    split = plan_prefill_chunks_by_area([A, B], 4, window=WINDOW, area_budget_rows=1017)
    assert [(c.start, c.end) for c in split] == [(0, 1), (1, 2)]
    assert split[0].width_rows == 1017 and split[1].width_rows == 75 + 300
    tiny = plan_prefill_chunks_by_area([A, B], 4, window=WINDOW, area_budget_rows=1)
    assert [(c.start, c.end) for c in tiny] == [(0, 1), (1, 2)]


def test_pr_example_ten_small_prefills_one_chunk_instead_of_three() -> None:
    shapes = [PrefillShape(0, 95)] * 9 + [PrefillShape(8000, 95)]
    kwargs = dict(group_size=4, max_model_len=16384, window=WINDOW, max_num_batched_tokens=8192)
    fixed = plan_prefill_chunks(shapes, 4, mode="fixed", **kwargs)
    area = plan_prefill_chunks(shapes, 4, mode="area", **kwargs)
    assert [c.num_requests for c in fixed] == [4, 4, 2]
    assert all(c.max_compressed_len == 4096 for c in fixed)  # sized by max context
    assert fixed[0].width_rows == 4096 + 128 + 8192
    assert len(area) == 1 and area[0].max_compressed_len == 2023  # 8095 // 4
    assert area[0].max_gather_len == 95 + 127
    assert sum(c.area_rows for c in area) < sum(c.area_rows for c in fixed) / 5


def test_explicit_area_budget_overrides_the_derived_one() -> None:
    kwargs = dict(group_size=4, max_model_len=4096, window=WINDOW, max_num_batched_tokens=2048)
    assert len(plan_prefill_chunks([A, B], 4, mode="area", **kwargs)) == 1
    split = plan_prefill_chunks([A, B], 4, mode="area", area_budget_rows=1500, **kwargs)
    assert [(c.start, c.end) for c in split] == [(0, 1), (1, 2)]


def test_unknown_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="prefill chunk plan"):
        plan_prefill_chunks(
            [A], 4, mode="max", group_size=4, max_model_len=4096, window=128,
            max_num_batched_tokens=16,
        )  # fmt: skip


shapes_st = st.lists(
    st.builds(PrefillShape, st.integers(0, 20_000), st.integers(1, 4_096)), max_size=24
)


@settings(max_examples=200, deadline=None)
@given(shapes=shapes_st, ratio=st.sampled_from([0, 4, 128]), budget=st.integers(1, 60_000))
def test_area_planner_invariants(shapes: list[PrefillShape], ratio: int, budget: int) -> None:
    chunks = plan_prefill_chunks_by_area(shapes, ratio, window=WINDOW, area_budget_rows=budget)
    check_partition(chunks, len(shapes))
    for chunk in chunks:
        members = shapes[chunk.start : chunk.end]
        assert chunk.max_compressed_len == max(compressed_len(s.seq_len, ratio) for s in members)
        assert chunk.max_gather_len == max(gather_len(s, WINDOW) for s in members)
        assert chunk.area_rows <= budget or chunk.num_requests == 1
    for chunk, following in itertools.pairwise(chunks):  # greedy: the next one would not fit
        grown = shapes[chunk.start : following.start + 1]
        width = max(compressed_len(s.seq_len, ratio) for s in grown)
        width += max(gather_len(s, WINDOW) for s in grown)
        assert len(grown) * width > budget


@settings(max_examples=100, deadline=None)
@given(
    num_prefills=st.integers(0, 40),
    ratio=st.sampled_from([0, 4, 128]),
    group_size=st.integers(1, 8),
    max_model_len=st.integers(1, 1 << 20),
)
def test_fixed_planner_matches_its_rule(
    num_prefills: int, ratio: int, group_size: int, max_model_len: int
) -> None:
    chunks = plan_prefill_chunks_fixed(
        num_prefills, ratio, group_size=group_size, max_model_len=max_model_len,
        window=WINDOW, max_num_batched_tokens=2048,
    )  # fmt: skip
    check_partition(chunks, num_prefills)
    assert len(chunks) == math.ceil(num_prefills / group_size)
    assert all(c.num_requests == group_size for c in chunks[:-1])
    width = worst_case_width_rows(
        ratio, max_model_len=max_model_len, window=WINDOW, max_num_batched_tokens=2048
    )
    assert all(c.width_rows == width for c in chunks)


@settings(max_examples=100, deadline=None)
@given(shapes=shapes_st, ratio=st.sampled_from([0, 4, 128]))
def test_area_plan_never_wider_than_fixed_for_fitting_requests(
    shapes: list[PrefillShape], ratio: int
) -> None:
    """With the shared budget, requests within the limits never need more chunks than the
    baseline, and every area chunk's workspace is no wider."""
    kwargs = dict(group_size=4, max_model_len=1 << 15, window=WINDOW, max_num_batched_tokens=4096)
    shapes = [s for s in shapes if s.seq_len <= 1 << 15]
    area = plan_prefill_chunks(shapes, ratio, mode="area", **kwargs)
    fixed = plan_prefill_chunks(shapes, ratio, mode="fixed", **kwargs)
    assert len(area) <= len(fixed)
    assert all(a.width_rows <= fixed[0].width_rows for a in area)


def check_partition(chunks: tuple[PrefillChunk, ...], num_prefills: int) -> None:
    """Every prefill request in exactly one chunk, in order, no empty chunk."""
    covered = [i for chunk in chunks for i in range(chunk.start, chunk.end)]
    assert covered == list(range(num_prefills))
    assert all(chunk.num_requests >= 1 for chunk in chunks)


LONG = dict(group_size=4, max_model_len=131072, window=WINDOW, max_num_batched_tokens=8192)


@pytest.mark.parametrize("ratio,last_n", [(4, 32768), (128, 1024)])
def test_128k_prompt_in_2048_token_chunks_sizes_by_its_real_length(ratio, last_n) -> None:
    """Each step of a 128K prefill gets a workspace of its own length; the fixed plan sizes
    every step for 128K + a whole token budget (N=32768, M=41088 for ratio 4)."""
    fixed_width = worst_case_width_rows(ratio, max_model_len=131072, window=WINDOW,
                                        max_num_batched_tokens=8192)  # fmt: skip
    area_rows = 0
    for k in range(64):
        shape = PrefillShape(2048 * k, 2048)
        (area,) = plan_prefill_chunks([shape], ratio, mode="area", **LONG)
        (fixed,) = plan_prefill_chunks([shape], ratio, mode="fixed", **LONG)
        assert area.max_compressed_len == 2048 * (k + 1) // ratio
        assert area.max_gather_len == 2048 + min(2048 * k, WINDOW - 1)
        assert fixed.width_rows == fixed_width and area.width_rows <= fixed_width
        area_rows += area.area_rows
    assert (area.max_compressed_len, area.width_rows) == (last_n, last_n + 2175)
    # Summed over the prefill, the area plan's workspace is about half the fixed plan's.
    assert area_rows < 0.55 * 64 * fixed_width


def test_128k_chunk_with_ten_short_prefills_packs_into_fewer_chunks() -> None:
    """The last 2048-token chunk of a 128K prompt plus 10 short prompts in one step: the
    long request caps its chunk at 4 requests (4 * 34943 <= 4 * 41088 < 5 * 34943), the rest
    share one narrow chunk; the fixed plan needs 3 chunks all sized for 128K."""
    shapes = [PrefillShape(129024, 2048)] + [PrefillShape(0, 95)] * 10
    area = plan_prefill_chunks(shapes, 4, mode="area", **LONG)
    fixed = plan_prefill_chunks(shapes, 4, mode="fixed", **LONG)
    assert [(c.start, c.end) for c in area] == [(0, 4), (4, 11)]
    assert (area[0].max_compressed_len, area[0].width_rows) == (32768, 34943)
    assert (area[1].max_compressed_len, area[1].width_rows) == (23, 23 + 95)
    assert [c.num_requests for c in fixed] == [4, 4, 3]
    assert all((c.max_compressed_len, c.width_rows) == (32768, 41088) for c in fixed)
    assert sum(c.area_rows for c in area) < 0.32 * sum(c.area_rows for c in fixed)  # 140598
