"""Decode CUDA graphs: bucket selection and padded, graph-safe inputs (CPU); capture and
replay of a toy graph-safe decode function against eager (GPU only)."""

from __future__ import annotations

import pytest
import torch

from dsv4.runner.graphs import (
    DecodeGraphs,
    DecodeInputs,
    bucket_for,
    capture_sizes,
    pad_decode_inputs,
)


def test_capture_sizes() -> None:
    assert capture_sizes(1) == (1,)
    assert capture_sizes(6) == (1, 2, 4, 6)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)


@pytest.mark.parametrize(
    ("num", "bucket"), [(1, 1), (3, 4), (5, 8), (8, 8), (9, 16), (17, 20), (21, None)]
)
def test_bucket_for(num: int, bucket: int | None) -> None:
    assert bucket_for(num, capture_sizes(20)) == bucket


def test_padding_rows_are_marked_and_reset() -> None:
    inputs = pad_decode_inputs(
        token_ids=[(5, 6, 7), (8, 9, 10)], start_positions=[40, 3],
        block_tables=[(4, 5), (6,)], ring_block_ids=[(0, 1), (2, 3)], bucket=4, max_blocks=3,
    )  # fmt: skip
    assert inputs.token_ids.shape == (4, 3) and inputs.block_tables.shape == (4, 3)
    assert inputs.positions[0].tolist() == [40, 41, 42] and inputs.positions[1].tolist() == [
        3,
        4,
        5,
    ]
    assert inputs.seq_lens.tolist() == [43, 6, 0, 0]
    assert inputs.request_index.tolist() == [0, 1, -1, -1]
    assert inputs.block_tables[1].tolist() == [6, -1, -1]
    assert inputs.ring_block_ids[2].tolist() == [-1, -1]
    with pytest.raises(ValueError):
        pad_decode_inputs([(1,)] * 5, [0] * 5, [(0,)] * 5, [(0,)] * 5, bucket=4, max_blocks=1)


def test_graphs_refuse_cpu() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(lambda x: x.token_ids, sizes=(1,), query_len=1, max_blocks=1,
                     num_ring_blocks=1, device="cpu")  # fmt: skip


@pytest.mark.gpu
def test_replay_matches_eager_on_cuda() -> None:
    torch.manual_seed(0)
    table = torch.randn(64, 32, device="cuda")
    weight = torch.randn(32, 50, device="cuda")

    def toy_decode(inputs: DecodeInputs) -> torch.Tensor:  # graph-safe: fixed shapes, no sync
        valid = (inputs.request_index >= 0).to(table.dtype)[:, None, None]
        hidden = table[inputs.token_ids] + inputs.positions.unsqueeze(-1).to(table.dtype)
        return (hidden @ weight) * valid  # [bucket, q, V]

    graphs = DecodeGraphs(toy_decode, sizes=capture_sizes(8), query_len=2, max_blocks=2,
                          num_ring_blocks=1, device="cuda")  # fmt: skip
    graphs.capture()
    for num in (8, 3, 1):  # a smaller step after a larger one: padding rows are reset
        ids = [(i, i + 1) for i in range(num)]
        starts = list(range(10, 10 + num))
        got = graphs.run(ids, starts, [(0,)] * num, [(0,)] * num)
        eager = toy_decode(pad_decode_inputs(ids, starts, [(0,)] * num, [(0,)] * num,
                                             num, 2, "cuda"))  # fmt: skip
        torch.testing.assert_close(got, eager)
    assert graphs.run([(0, 0)] * 9, [0] * 9, [(0,)] * 9, [(0,)] * 9) is None
