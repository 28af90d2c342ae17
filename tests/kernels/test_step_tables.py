"""compressor_tables and window_tables (one launch each) against their torch formulas, and the
compressor tables against the host-built ones an eager step uploads (the values a captured step
must reproduce on the device)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.step_tables import (
    compressor_tables,
    compressor_tables_ref,
    window_tables,
    window_tables_ref,
)
from tests.kernels.conftest import DEVICE

# (ratio, candidate positions, draft slots, entries per block): V4-Flash's C4 (overlap 2) and
# C128 (no overlap) compressors, with and without MTP's draft slots
SHAPES = [(4, 8, 0, 32), (4, 8, 2, 32), (128, 128, 1, 1)]


def _step(num_reqs: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A mixed step: each request has a start in 0..600 and 1..5 tokens (decode rows, drafts,
    a short chunk), one request of 40 tokens when there are several (a prefill)."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 600, (num_reqs,), generator=gen)
    lens = torch.randint(1, 6, (num_reqs,), generator=gen)
    if num_reqs > 1:
        lens[1] = 40
    ends = starts + lens
    t2r = torch.repeat_interleave(torch.arange(num_reqs), lens)
    pos = torch.cat([torch.arange(s, e) for s, e in zip(starts.tolist(), ends.tolist())])
    return pos, t2r.int(), starts, ends


@pytest.mark.parametrize("shape", SHAPES, ids=["c4", "c4-mtp2", "c128-mtp1"])
@pytest.mark.parametrize("num_reqs", [1, 5, 33])
def test_compressor_tables_match_reference(shape, num_reqs) -> None:
    ratio, num_cand, drafts, epb = shape
    pos, t2r, starts, ends = (x.to(DEVICE) for x in _step(num_reqs, num_reqs + ratio))
    freq = torch.logspace(0, -4, 32, dtype=torch.float32).to(DEVICE)
    kw = dict(ratio=ratio, num_cand=num_cand, slots=num_cand + drafts, entries_per_block=epb,
              max_col=5)  # fmt: skip
    got, want = (
        compressor_tables(pos, t2r, starts, ends, freq, **kw),
        compressor_tables_ref(pos, t2r, starts, ends, freq, **kw),
    )
    for name, g, w in zip(want._fields, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype)
        assert torch.equal(g, w), name  # integer math and one fp32 product: exact
    assert int(got.entry_col.max()) <= 5  # the clamp to the block table's last column is hit
    assert bool((got.cand_slots == -1).any()) == bool((pos < num_cand - 1).any())


def test_compressor_tables_equal_the_host_formulas() -> None:
    """The host tables' numpy formulas (dsv4.runner.paged.compress, every token a program) on
    the same step give the same values: a captured step compresses as an eager one."""
    pos, t2r, starts, ends = _step(7, 3)
    ratio, num_cand, slots, epb = 4, 8, 10, 32
    freq = torch.logspace(0, -4, 32, dtype=torch.float32)
    got = compressor_tables(pos.to(DEVICE), t2r.to(DEVICE), starts.to(DEVICE), ends.to(DEVICE),
                            freq.to(DEVICE), ratio=ratio, num_cand=num_cand, slots=slots,
                            entries_per_block=epb, max_col=9)  # fmt: skip
    p = pos.numpy()
    entry = np.maximum((p + 1) // ratio - 1, 0)
    cand = p[:, None] - num_cand + 1 + np.arange(num_cand)
    angles = (entry * ratio).astype(np.float32)[:, None] * freq.numpy()
    want = {
        "num_in_step": p - starts.numpy()[t2r.numpy()] + 1,
        "cand_slots": np.where(cand >= 0, cand % slots, -1),
        "entry_col": np.minimum(entry // epb, 9), "entry_row": entry % epb,
        "save_slots": np.where(p >= ends.numpy()[t2r.numpy()] - slots, p % slots, -1),
        "phase": p % ratio, "angles": angles,
    }  # fmt: skip
    for name, values in want.items():
        assert np.array_equal(getattr(got, name).cpu().numpy(), values), name


def test_an_empty_step_launches_nothing() -> None:
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    got = compressor_tables(empty, empty.int(), empty, empty, torch.ones(32, device=DEVICE),
                            ratio=4, num_cand=8, slots=8, entries_per_block=32, max_col=0)  # fmt: skip
    assert got.cand_slots.shape == (0, 8) and got.angles.shape == (0, 32)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", SHAPES, ids=["c4", "c4-mtp2", "c128-mtp1"])
def test_compressor_tables_served_batch_gpu(shape) -> None:
    """128 decode requests (the largest captured bucket) deep into long contexts."""
    ratio, num_cand, drafts, epb = shape
    starts = torch.randint(0, 1 << 20, (128,), generator=torch.Generator().manual_seed(ratio))
    ends = starts + 1 + drafts
    pos = torch.stack([starts + j for j in range(1 + drafts)], dim=1).flatten()
    t2r = torch.arange(128).repeat_interleave(1 + drafts).int()
    args = [x.cuda() for x in (pos, t2r, starts, ends)] + [torch.rand(32, device="cuda")]
    kw = dict(ratio=ratio, num_cand=num_cand, slots=num_cand + drafts, entries_per_block=epb,
              max_col=(1 << 20) // (epb * ratio))  # fmt: skip
    for g, w in zip(compressor_tables(*args, **kw), compressor_tables_ref(*args, **kw)):
        assert torch.equal(g, w)


def _window_args(num_reqs: int, num_layers: int, seed: int) -> tuple[list, dict]:
    pos, t2r, _, ends = _step(num_reqs, seed)
    gen = torch.Generator().manual_seed(seed)
    ring_ids = torch.randint(0, 5000, (num_reqs, 9), generator=gen)
    rbi = torch.randint(0, 9, (num_layers,), generator=gen)
    base = torch.randint(0, 300, (num_layers,), generator=gen)
    args = [x.to(DEVICE) for x in (pos, t2r, ends, ring_ids, rbi, base)]
    return args, dict(slots_per_block=384, ring=16)


@pytest.mark.parametrize("num_layers", [1, 4, 43])  # 43: V4-Flash, several layer blocks
@pytest.mark.parametrize("num_reqs", [1, 6])
def test_window_tables_match_reference(num_layers, num_reqs) -> None:
    args, kw = _window_args(num_reqs, num_layers, num_layers + num_reqs)
    got, want = window_tables(*args, **kw), window_tables_ref(*args, **kw)
    for name, g, w in zip(want._fields, got, want):
        assert g.dtype == w.dtype == torch.int32 and g.shape == w.shape, name
        assert torch.equal(g, w), name
    assert bool((got.win_rel == -1).any()) == (num_reqs > 1)  # the 40-token request's early rows


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
def test_window_tables_served_batch_gpu() -> None:
    args, kw = _window_args(128, 43, 0)
    args = [a.cuda() for a in args]
    for g, w in zip(window_tables(*args, **kw), window_tables_ref(*args, **kw)):
        assert torch.equal(g, w)
