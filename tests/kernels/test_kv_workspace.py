"""kv_workspace (kernels/kv_workspace.py) against its torch reference and against the path it
replaces (kv_gather of the cached rows, kv_store + kv_gather of the fresh rows through a
scratch, kv_store of the window rows), bit for bit, workspace and cache bytes alike.

Every cache record is a real one (rows stored with kv_store first, the corner-case rows of
test_kv_store: clamped scales, huge values, signed zeros, bf16 ties, e4m3 subnormals); bytes
past each record's `cache.shape[1]` are random and must stay untouched. Workspace rows mix all
four sources in a shuffled order: compressed entries (the layer's page at `comp_base`), window
prefix rows (two requests' ring pages, through a token's `win_base`), fresh rows, padding.
"""

from __future__ import annotations

import pytest
import torch

from kernels.kv_store import FORMATS, kv_gather, kv_store, min_entry_bytes
from kernels.kv_workspace import kv_workspace, kv_workspace_ref
from tests.kernels.test_kv_store import OUTSIDE_BYTES, TAIL_BYTES, _bits, _poisoned_cache, _rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(fmt, dtype, dim, rope, *, tokens, ring, entries, window, seed, stride0=False):
    """(rows [T, D], poisoned cache [S, entry + OUTSIDE] of real records, src [2, M] int32,
    win_base [T] int32, store [T] int32, comp_base): two requests (tokens split in half, ring
    pages at 0 and `ring`; one shared page when `stride0`, as one prefill's stride-0 view),
    `entries` compressed entries of a page at 2 * ring, `window` prefix rows a request reading
    ring slots 0..window-1, stores into slots window.. only (no slot both read and stored)."""
    g = torch.Generator().manual_seed(seed)
    comp_base = 2 * ring
    num_slots = comp_base + entries + 3
    entry = min_entry_bytes(fmt, dim, rope) + TAIL_BYTES
    cache, records = _poisoned_cache(num_slots, entry, seed=seed)
    every = torch.arange(num_slots, dtype=torch.int32, device=DEVICE)
    kv_store(_rows(num_slots, dim, dtype, seed=seed + 1), records, every, fmt=fmt, rope_dim=rope)
    rows = _rows(tokens, dim, dtype, seed=seed + 2)  # [T, D] fresh rows
    half = tokens // 2
    if stride0:
        win_base = torch.zeros(1, dtype=torch.int32, device=DEVICE).expand(tokens)
    else:
        win_base = (torch.arange(tokens, device=DEVICE) >= half).int() * ring
    reqs = (0,) if stride0 else (0, half)
    comp = [(i, -1) for i in torch.randperm(entries, generator=g)[: entries - 2].tolist()]
    win = [(j, r) for r in reqs for j in range(window)]
    fresh = [(-1, t) for t in range(tokens)]
    cols = comp + win + fresh + [(-1, -1)] * 5
    order = torch.randperm(len(cols), generator=g).tolist()
    src = torch.tensor([cols[i] for i in order], dtype=torch.int32).T.contiguous().to(DEVICE)
    # token t stores at ring slot window + t % P (P = ring - window) unless token t + P of its
    # request takes that slot (as the engine keeps a request's last R positions)
    t = torch.arange(tokens)
    period, end = ring - window, torch.where(t < half, half, tokens)
    store = torch.where(t + period < end, -1, window + t % period).int().to(DEVICE)
    return rows, cache, src, win_base, store, comp_base


def _replaced_path(rows, records, src, win_base, store, fmt, rope, comp_base):
    """What the paged forward did before the op: (workspace, records after the window store)."""
    dim = rows.shape[1]
    slot, tok = src.long()
    ws = torch.zeros(src.shape[1], dim, dtype=rows.dtype, device=rows.device)
    cached, fresh = slot >= 0, (slot < 0) & (tok >= 0)
    base = torch.where(tok >= 0, win_base.long()[tok.clamp(min=0)], comp_base)
    kw = dict(fmt=fmt, dim=dim, rope_dim=rope, out_dtype=rows.dtype)
    ws[cached] = kv_gather(records, (slot + base)[cached], **kw)
    scratch = torch.zeros(int(fresh.sum()), records.shape[1], dtype=torch.uint8, device=DEVICE)
    own = torch.arange(scratch.shape[0], device=DEVICE)
    kv_store(rows[tok[fresh]].contiguous(), scratch, own, fmt=fmt, rope_dim=rope)
    ws[fresh] = kv_gather(scratch, own, **kw)
    after = records.clone()
    if store is not None:
        slots = torch.where(store >= 0, win_base.long() + store, -1)
        kv_store(rows, after, slots, fmt=fmt, rope_dim=rope)
    return ws, after


def _check(fmt, dtype, dim, rope, *, with_store=True, **sizes):
    rows, cache, src, win_base, store, comp_base = _case(fmt, dtype, dim, rope, **sizes)
    store = store if with_store else None
    entry = cache.shape[1] - OUTSIDE_BYTES
    kw = dict(fmt=fmt, rope_dim=rope, comp_base=comp_base)
    want_ws, want_records = _replaced_path(rows, cache[:, :entry], src, win_base, store, fmt,
                                           rope, comp_base)  # fmt: skip
    got_cache, ref_cache = cache.clone(), cache.clone()
    got = kv_workspace(rows, got_cache[:, :entry], src, win_base, store, **kw)
    ref = kv_workspace_ref(rows, ref_cache[:, :entry], src, win_base, store, **kw)
    assert got.dtype == dtype and got.shape == (src.shape[1], dim)
    assert torch.equal(_bits(got), _bits(ref))
    assert torch.equal(_bits(got), _bits(want_ws))
    assert torch.equal(got_cache, ref_cache)
    assert torch.equal(got_cache[:, :entry], want_records)
    assert torch.equal(got_cache[:, entry:], cache[:, entry:])  # bytes past the records
    padding = (src < 0).all(0)
    assert padding.any() and not _bits(got[padding]).any()  # +0.0


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("dim", "rope"), [(128, 64), (512, 64), (256, 32)])
def test_kv_workspace_matches_ref_and_the_replaced_path(fmt, dtype, dim, rope):
    _check(fmt, dtype, dim, rope, tokens=14, ring=8, entries=11, window=3, seed=dim + rope)


@pytest.mark.parametrize("fmt", FORMATS)
def test_kv_workspace_one_request_stride0_bases_no_store(fmt):
    """One prefill: every token's window base is one stride-0 view; no store in the launch."""
    _check(fmt, torch.bfloat16, 128, 64, with_store=False, tokens=9, ring=8, entries=6,
           window=4, seed=5, stride0=True)  # fmt: skip


@pytest.mark.parametrize("fmt", FORMATS)
def test_kv_workspace_store_alone(fmt):
    """No workspace rows (M = 0): the launch is kv_store at the ring slots base + rel."""
    rows, cache, src, win_base, store, _ = _case(fmt, torch.bfloat16, 128, 64, tokens=10, ring=8,
                                                 entries=4, window=2, seed=6)  # fmt: skip
    entry = cache.shape[1] - OUTSIDE_BYTES
    none = src[:, :0]
    got_cache, want = cache.clone(), cache.clone()
    out = kv_workspace(rows, got_cache[:, :entry], none, win_base, store, fmt=fmt)
    assert out.shape == (0, 128)
    kv_store(rows, want[:, :entry], torch.where(store >= 0, win_base + store, -1), fmt=fmt)
    assert torch.equal(got_cache, want)
    ref_cache = cache.clone()
    kv_workspace_ref(rows, ref_cache[:, :entry], none, win_base, store, fmt=fmt)
    assert torch.equal(ref_cache, want)
    assert kv_workspace(rows, got_cache[:, :entry], none, win_base, fmt=fmt).shape == (0, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_workspace_production_shape_gpu(fmt, dtype):
    """A 1024-token chunk of two requests at D = 512: 256 entries, 127 window-prefix rows a
    request, the window ring store (R = 256) in the same launch."""
    _check(fmt, dtype, 512, 64, tokens=1024, ring=256, entries=256, window=127, seed=7)
