"""ring_offsets (one launch) against the torch index math of the compressor's state rows."""

from __future__ import annotations

import pytest
import torch

from kernels.ring_offsets import ring_offsets, ring_offsets_ref
from tests.kernels.conftest import DEVICE

# (requests, ring blocks, rows, slots per row): empty, one, odd, a padding request (-1)
CASES = [(2, 3, 0, 1), (1, 1, 1, 1), (3, 4, 7, 1), (5, 3, 9, 8), (4, 2, 33, 6)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("two_dim", [False, True])
def test_ring_offsets_match_reference(case, two_dim) -> None:
    num_reqs, num_ring, rows, width = case
    gen = torch.Generator().manual_seed(rows)
    ring_ids = torch.randint(0, 1000, (num_reqs, num_ring), generator=gen).to(DEVICE)
    reqs = torch.randint(-1, num_reqs, (rows,), generator=gen).to(DEVICE)  # -1: padding
    epb = 5
    shape = (rows, width) if two_dim else (rows,)
    slots = torch.randint(-1, epb * (num_ring - 1) + epb, shape, generator=gen).to(DEVICE)
    # ring geometry of a real layer: block index 1 when there are several ring blocks
    rbi = 0 if num_ring == 1 else 1
    slots = slots.clamp(max=epb * (num_ring - rbi) - 1)
    args = (ring_ids, reqs, slots, rbi, epb, 1 << 20, 4096, 1152)
    got, want = ring_offsets(*args), ring_offsets_ref(*args)
    assert got.dtype == want.dtype == torch.int64 and got.shape == slots.shape
    assert torch.equal(got, want)
    assert bool((got[slots < 0] == -1).all())


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
def test_production_shape_gpu() -> None:
    """64 requests, V4-Flash c4 candidates (2 x 4 + 3 draft slots), rows of 128 tokens."""
    gen = torch.Generator().manual_seed(0)
    ring_ids = torch.randint(0, 4096, (64, 17), generator=gen).cuda()
    reqs = torch.arange(64).cuda()
    slots = torch.randint(-1, 11, (64, 8), generator=gen).cuda()
    args = (ring_ids, reqs, slots, 16, 11, 1 << 21, 8192, 2048)
    assert torch.equal(ring_offsets(*args), ring_offsets_ref(*args))
