"""Per-step metadata kernels (kernels/metadata.py) against their references and their slow
paths, plus the bookkeeping oracle of docs/model.md#bookkeeping-example."""

from __future__ import annotations

import pytest
import torch

from kernels.metadata import (
    c4_global_topk_slots,
    c4_global_topk_slots_ref,
    c128_index_table,
    c128_index_table_prefill,
    c128_index_table_ref,
    token_to_req_indices,
    token_to_req_indices_per_builder,
    token_to_req_indices_ref,
    window_slot_table,
    window_slot_table_prefill,
    window_slot_table_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _qsl(query_lens):
    lens = torch.tensor(query_lens, dtype=torch.int32)
    return torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()]).to(DEVICE)


def _batch(query_lens, prefix_lens, num_tokens, max_blocks, seed):
    """positions, token_to_req, and a random block table for a mixed batch (+ padding)."""
    g = torch.Generator().manual_seed(seed)
    pos = [torch.arange(p, p + q) for p, q in zip(prefix_lens, query_lens)]
    pos = torch.cat([*pos, torch.zeros(num_tokens - sum(query_lens), dtype=torch.long)])
    t2r = token_to_req_indices_ref(_qsl(query_lens), num_tokens)
    num_blocks = len(query_lens) * max_blocks
    table = torch.randperm(max(10_000, num_blocks), generator=g)[:num_blocks]
    return pos.to(DEVICE), t2r, table.view(-1, max_blocks).int().to(DEVICE)


def _equal(got, expect):
    for a, b in zip(got, expect):
        assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b), (a, b)


@pytest.mark.parametrize(
    ("query_lens", "num_tokens"),
    [([], 0), ([1], 1), ([3, 0, 1, 13], 17), ([3, 0, 1, 13], 20), ([5] * 9, 45)],
)
def test_token_to_req_indices(query_lens, num_tokens):
    qsl = _qsl(query_lens)
    expect = token_to_req_indices_ref(qsl, num_tokens)
    assert torch.equal(token_to_req_indices(qsl, num_tokens), expect)
    assert torch.equal(token_to_req_indices_per_builder(qsl, num_tokens), expect)
    if num_tokens > sum(query_lens):
        assert (expect[sum(query_lens) :] == -1).all()


CASES = [  # query lens, prefix lens, padded token count
    ([], [], 0),
    ([1], [0], 1),
    ([3, 1, 13], [5, 300, 0], 17),
    ([1, 1, 1, 1], [999, 128, 4095, 4], 5),  # decode positions, one padding token
]


@pytest.mark.parametrize(("query_lens", "prefix_lens", "num_tokens"), CASES)
@pytest.mark.parametrize(("window", "block_size"), [(8, 4), (32, 16), (5, 3)])
def test_window_slot_table(query_lens, prefix_lens, num_tokens, window, block_size):
    pos, t2r, table = _batch(query_lens, prefix_lens, num_tokens, 4200 // block_size, 1)
    expect = window_slot_table_ref(pos, t2r, table, window, block_size)
    _equal(window_slot_table(pos, t2r, table, window, block_size), expect)
    _equal(window_slot_table_prefill(pos, t2r, table, window, block_size), expect)
    dirty = torch.full((num_tokens, window), 7, dtype=torch.int32, device=DEVICE)
    _equal(window_slot_table(pos, t2r, table, window, block_size, out=dirty), expect)


@pytest.mark.parametrize(("query_lens", "prefix_lens", "num_tokens"), CASES)
@pytest.mark.parametrize(
    ("width", "entries_per_block", "ratio"), [(40, 2, 128), (70, 4, 4), (3, 2, 4)]
)
def test_c128_index_table(query_lens, prefix_lens, num_tokens, width, entries_per_block, ratio):
    pos, t2r, table = _batch(query_lens, prefix_lens, num_tokens, 1100 // entries_per_block, 2)
    args = (pos, t2r, table, width, entries_per_block, ratio)
    expect = c128_index_table_ref(*args)
    _equal(c128_index_table(*args), expect)
    _equal(c128_index_table_prefill(*args), expect)


def test_section_9_1_oracle():
    """Decode positions p = [999, 128, 4095, 4]: window lengths min(p+1, 128) = [128, 128,
    128, 5]; C128 entries visible floor((p+1)/128) = [7, 1, 32, 0]."""
    pos, t2r, table = _batch([1, 1, 1, 1], [999, 128, 4095, 4], 4, 64, 3)
    slots, lens = window_slot_table(pos, t2r, table, 128, 64)
    assert lens.tolist() == [128, 128, 128, 5]
    p = 999  # req 0: first slot is position 872 = block 13, offset 40
    assert slots[0, 0].item() == table[0, 872 // 64].item() * 64 + 872 % 64
    assert slots[0, -1].item() == table[0, p // 64].item() * 64 + p % 64
    assert slots[3, 5:].eq(-1).all() and slots[3, :5].ge(0).all()
    _, lens = c128_index_table(pos, t2r, table, 64, 2)
    assert lens.tolist() == [7, 1, 32, 0]


@pytest.mark.parametrize("num_tokens", [0, 1, 17])
@pytest.mark.parametrize(("topk", "entries_per_block"), [(12, 4), (16, 64), (5, 2)])
def test_c4_global_topk_slots(num_tokens, topk, entries_per_block):
    g = torch.Generator().manual_seed(num_tokens + topk)
    query_lens = [num_tokens // 2, num_tokens - num_tokens // 2 - (num_tokens > 2)]
    t2r = token_to_req_indices_ref(_qsl(query_lens), num_tokens)
    table = torch.randperm(5000, generator=g)[:200].view(2, 100).int().to(DEVICE)
    local = torch.randint(-1, 100 * entries_per_block, (num_tokens, topk), generator=g)
    local = local.int().to(DEVICE)
    expect = c4_global_topk_slots_ref(local, t2r, table, entries_per_block)
    _equal(c4_global_topk_slots(local, t2r, table, entries_per_block), expect)
    if num_tokens > 2:
        assert expect[1][-1].item() == 0  # the padding token


@pytest.mark.gpu
def test_metadata_production_shapes_gpu():
    num_reqs, max_blocks = 64, 4096  # decode: 64 requests up to 1M tokens; then an 8K prefill
    for query_lens, prefix_lens in [([1] * num_reqs, [31_000 + 97 * r for r in range(num_reqs)]),
                                    ([8192], [32_768])]:  # fmt: skip
        num_tokens = sum(query_lens)
        pos, t2r, table = _batch(query_lens, prefix_lens, num_tokens, max_blocks, 4)
        qsl = _qsl(query_lens)
        assert torch.equal(token_to_req_indices(qsl, num_tokens), t2r)
        _equal(window_slot_table(pos, t2r, table, 128, 64),
               window_slot_table_ref(pos, t2r, table, 128, 64))  # fmt: skip
        args = (pos, t2r, table, 8192, 2)
        _equal(c128_index_table(*args), c128_index_table_ref(*args))
        local = torch.randint(-1, 10_000, (num_tokens, 512), device=DEVICE, dtype=torch.int32)
        _equal(c4_global_topk_slots(local, t2r, table, 64),
               c4_global_topk_slots_ref(local, t2r, table, 64))  # fmt: skip
