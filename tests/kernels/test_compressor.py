"""compressor_step (kernels/compressor.py) against compressor_step_ref on the same ring
contents, the always-launch slow path (#48957), and a chunked-vs-whole-sequence oracle built
from the model's `compress_windows` (docs/model.md#compressor).

Quantised bytes are compared exactly where they agree and, decoded, within one code step where
a last-bit difference of exp/rsqrt flips a rounding (docs/architecture.md#platform-notes).
"""

from __future__ import annotations

import pytest
import torch

from dsv4.ops.compressor import compress_windows
from dsv4.ops.kv_codec import decode_rows, encode_rows
from dsv4.ops.norm import rms_norm
from dsv4.ops.rope import apply_rope
from kernels.compressor import (
    compressor_step,
    compressor_step_always,
    compressor_step_always_ref,
    compressor_step_ref,
    entry_bytes,
)
from kernels.ring_offsets import PagedAddress

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _step_meta(prefix_lens, query_lens, ratio, ring, freq, entry_base=None):
    """Per-step metadata for dense per-request rings (row = req * ring + pos % ring)."""
    num_cand = ratio * (2 if ratio == 4 else 1)
    pos, req, nis, save = [], [], [], []
    for b, (p0, q) in enumerate(zip(prefix_lens, query_lens)):
        for i in range(q):
            p = p0 + i
            pos.append(p)
            req.append(b)
            nis.append(i + 1)
            save.append(b * ring + p % ring if i >= q - ring else -1)  # last `ring` only
    pos_t = torch.tensor(pos, dtype=torch.long)
    bnd = [t for t, p in enumerate(pos) if (p + 1) % ratio == 0]
    rows = [[req[t] * ring + (q % ring) if q >= 0 else -1
             for q in range(pos[t] - num_cand + 1, pos[t] + 1)] for t in bnd]  # fmt: skip
    entry_pos = torch.tensor([pos[t] + 1 - ratio for t in bnd], dtype=torch.float32)
    angles = entry_pos[:, None] * freq[None, :]
    if entry_base is None:
        slots = torch.randperm(max(len(bnd), 1) * 3)[: len(bnd)]
    else:  # entry i of request b at row entry_base[b] + i
        slots = torch.tensor([entry_base[req[t]] + (pos[t] + 1) // ratio - 1 for t in bnd])
    i32 = dict(dtype=torch.int32, device=DEVICE)
    return dict(
        positions=pos_t.to(DEVICE),
        save_slots=torch.tensor(save, **i32),
        boundary=torch.tensor(bnd, **i32),
        num_in_step=torch.tensor([nis[t] for t in bnd], **i32),
        window_rows=torch.tensor(rows, **i32).view(len(bnd), num_cand),
        cos=angles.cos().to(DEVICE),
        sin=angles.sin().to(DEVICE),
        entry_slots=slots.to(torch.int32).to(DEVICE),
    )


def _inputs(num_tokens, width, num_reqs, ring, dim, seed):
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(num_tokens, width, generator=g) * 2).to(DEVICE)
    gate = (torch.randn(num_tokens, width, generator=g) * 1.5).to(DEVICE)
    state = torch.randn(num_reqs * ring, 2 * width, generator=g).to(DEVICE)
    weight = (1 + 0.2 * torch.randn(dim, generator=g)).bfloat16().to(DEVICE)
    return kv, gate, state, weight


def _assert_entries_close(got, ref, fmt, dim, rope_dim):
    """Bytes mostly identical; decoded values within one quantisation step."""
    same = (got == ref).float().mean().item()
    assert same >= 0.97, f"only {same:.3f} of the bytes agree"
    a = decode_rows(got, fmt, dim, rope_dim)
    b = decode_rows(ref, fmt, dim, rope_dim)
    step = {"fp8_ue8m0": 0.125, "mxfp4": 0.34, "fp8_fp32scale": 0.125}[fmt]
    tol = b.abs() * step + b.abs().amax(dim=1, keepdim=True) * 0.02 + 1e-3
    assert ((a - b).abs() <= tol).all(), (a - b).abs().max()


CASES = [  # (ratio, dim, rope, fmt, prefix lens, query lens)
    (4, 64, 32, "fp8_ue8m0", [0], [0]),  # empty step
    (4, 64, 32, "fp8_ue8m0", [6], [1]),  # one decode token, no boundary
    (4, 64, 32, "fp8_ue8m0", [2, 10, 0], [2, 2, 1]),  # decode/boundary mix, window 0 and 2
    (4, 64, 32, "mxfp4", [5, 0], [9, 3]),  # prefill chunks, ring wrap inside the chunk
    (4, 128, 64, "fp8_fp32scale", [1, 7], [1, 5]),
    (8, 64, 32, "fp8_ue8m0", [3, 13], [5, 3]),  # non-overlapping small window
    (128, 64, 32, "fp8_ue8m0", [127, 200], [1, 56]),  # the real r = 128
]


@pytest.mark.parametrize(("ratio", "dim", "rope", "fmt", "prefix", "query"), CASES)
def test_compressor_step_matches_ref(ratio, dim, rope, fmt, prefix, query):
    c = 2 if ratio == 4 else 1
    ring = c * ratio + 1  # one spare slot, as with a speculative token
    meta = _step_meta(prefix, query, ratio, ring, torch.rand(rope // 2))
    kv, gate, state, weight = _inputs(sum(query), c * dim, len(query), ring, dim, ratio + dim)
    rows = max([*meta["entry_slots"].tolist(), 0]) + 1
    cache = torch.zeros(rows, entry_bytes(fmt, dim, rope) + 3, dtype=torch.uint8, device=DEVICE)
    args = (kv, gate, meta["positions"])
    tail = [meta[k] for k in ("save_slots", "boundary", "num_in_step", "window_rows")]
    rest = (weight, meta["cos"], meta["sin"])
    kw = dict(ratio=ratio, fmt=fmt, rope_dim=rope)
    s_ref, c_ref = state.clone(), cache.clone()
    compressor_step_ref(*args, s_ref, *tail, *rest, c_ref, meta["entry_slots"], **kw)
    s_tri, c_tri = state.clone(), cache.clone()
    out = compressor_step(*args, s_tri, *tail, *rest, c_tri, meta["entry_slots"], **kw)
    assert out is c_tri and torch.equal(s_tri, s_ref)
    n = entry_bytes(fmt, dim, rope)
    assert torch.equal(c_tri[:, n:], c_ref[:, n:])  # nothing past the entry is touched
    if meta["boundary"].numel():
        idx = meta["entry_slots"].long()
        _assert_entries_close(c_tri[idx, :n], c_ref[idx, :n], fmt, dim, rope)
    else:
        assert torch.equal(c_tri, cache)


def test_compressor_always_launch_baseline_agrees():
    ratio, dim, rope, fmt = 4, 64, 32, "fp8_ue8m0"
    prefix, query = [2, 9], [3, 2]
    ring = 2 * ratio
    meta = _step_meta(prefix, query, ratio, ring, torch.rand(rope // 2))
    kv, gate, state, weight = _inputs(5, 2 * dim, 2, ring, dim, 1)
    # per-token tables for the slow path: the boundary rows scattered to their tokens
    t, nb = 5, meta["boundary"].long()
    per_tok = dict(
        num_in_step=torch.ones(t, dtype=torch.int32, device=DEVICE),
        window_rows=torch.full((t, 2 * ratio), -1, dtype=torch.int32, device=DEVICE),
        cos=torch.ones(t, rope // 2, device=DEVICE), sin=torch.zeros(t, rope // 2, device=DEVICE),
        entry_slots=torch.zeros(t, dtype=torch.int32, device=DEVICE),
    )  # fmt: skip
    for k in per_tok:
        per_tok[k][nb] = meta[k]
    cache = torch.zeros(8, entry_bytes(fmt, dim, rope), dtype=torch.uint8, device=DEVICE)
    kw = dict(ratio=ratio, fmt=fmt, rope_dim=rope)
    s1, c1, s2, c2 = state.clone(), cache.clone(), state.clone(), cache.clone()
    compressor_step(kv, gate, meta["positions"], s1, meta["save_slots"], meta["boundary"],
                    meta["num_in_step"], meta["window_rows"], weight, meta["cos"], meta["sin"],
                    c1, meta["entry_slots"], **kw)  # fmt: skip
    compressor_step_always(kv, gate, meta["positions"], s2, meta["save_slots"], meta["boundary"],
                           per_tok["num_in_step"], per_tok["window_rows"], weight,
                           per_tok["cos"], per_tok["sin"], c2, per_tok["entry_slots"], **kw)  # fmt: skip
    assert torch.equal(s1, s2) and torch.equal(c1, c2)


@pytest.mark.parametrize(("ratio", "fmt"), [(4, "mxfp4"), (8, "fp8_ue8m0")])
def test_chunked_steps_equal_whole_sequence(ratio, fmt):
    """Steps through the ring give the entries of the model's one-shot compression."""
    dim, rope, length, chunks = 64, 32, 24, [5, 1, 1, 3, 6, 8]
    c = 2 if ratio == 4 else 1
    ring = c * ratio
    freq = torch.rand(rope // 2)
    kv, gate, state, weight = _inputs(length, c * dim, 1, ring, dim, 7)
    n_entries = length // ratio
    nbytes = entry_bytes(fmt, dim, rope)
    cache = torch.zeros(n_entries, nbytes, dtype=torch.uint8, device=DEVICE)
    start = 0
    for q in chunks:
        meta = _step_meta([start], [q], ratio, ring, freq, entry_base=[0])
        compressor_step(kv[start : start + q], gate[start : start + q], meta["positions"], state,
                        meta["save_slots"], meta["boundary"], meta["num_in_step"],
                        meta["window_rows"], weight, meta["cos"], meta["sin"], cache,
                        meta["entry_slots"], ratio=ratio, fmt=fmt, rope_dim=rope)  # fmt: skip
        start += q
    usable = n_entries * ratio
    new = compress_windows(kv[:usable].view(n_entries, ratio, -1),
                                     gate[:usable].view(n_entries, ratio, -1), None, None,
                                     ratio == 4)  # fmt: skip
    new = rms_norm(new.to(torch.bfloat16), weight, 1e-6)
    angles = (torch.arange(n_entries) * ratio).float()[:, None] * freq[None, :]
    new = apply_rope(new, angles.cos().to(DEVICE), angles.sin().to(DEVICE))
    _assert_entries_close(cache, encode_rows(new, fmt, nbytes, rope), fmt, dim, rope)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("ratio", "dim", "fmt"),
    [(4, 512, "fp8_ue8m0"), (128, 512, "fp8_ue8m0"), (4, 128, "mxfp4"), (4, 128, "fp8_fp32scale")],
)
def test_compressor_step_production_shapes_gpu(ratio, dim, fmt):
    """Decode batch of 64 (some at a boundary) plus a 2048-token prefill chunk."""
    c = 2 if ratio == 4 else 1
    ring = c * ratio + 1
    prefix = [ratio * 9 + (b % ratio) - 1 for b in range(64)] + [ratio * 3 + 1]
    query = [1] * 64 + [2048]
    meta = _step_meta(prefix, query, ratio, ring, torch.rand(32))
    kv, gate, state, weight = _inputs(sum(query), c * dim, 65, ring, dim, 0)
    rows = max(meta["entry_slots"].tolist()) + 1
    cache = torch.zeros(rows, entry_bytes(fmt, dim, 64), dtype=torch.uint8, device=DEVICE)
    tail = [meta[k] for k in ("save_slots", "boundary", "num_in_step", "window_rows")]
    kw = dict(ratio=ratio, fmt=fmt, rope_dim=64)
    s_ref, c_ref, s_tri, c_tri = state.clone(), cache.clone(), state.clone(), cache.clone()
    compressor_step_ref(kv, gate, meta["positions"], s_ref, *tail, weight, meta["cos"],
                        meta["sin"], c_ref, meta["entry_slots"], **kw)  # fmt: skip
    compressor_step(kv, gate, meta["positions"], s_tri, *tail, weight, meta["cos"], meta["sin"],
                    c_tri, meta["entry_slots"], **kw)  # fmt: skip
    assert torch.equal(s_tri, s_ref)
    idx = meta["entry_slots"].long()
    _assert_entries_close(c_tri[idx], c_ref[idx], fmt, dim, 64)


def _rows(flat: torch.Tensor, width: int) -> torch.Tensor:
    """[n, width] rows of `flat` addressed by element offset (stride (1, 1)), as the paged
    cache's state and indexer views (dsv4/runner/paged/geometry.py)."""
    return torch.as_strided(flat, (flat.numel() - width + 1, width), (1, 1))


def _paged_case(prefix_lens, query_lens, ratio, fmt, dim, rope, seed):
    """The paged forward's call: kv and gate the halves of one [T, 2W] projection, z without
    ape, ring slots over multi-block state rings (ring block index 1, 3 padded rows a block)
    and entries by block-table column in a byte-addressed page. Returns the projection, ape,
    norm weight, per-token tables, their PagedAddress and the flat state and cache storages."""
    c = 2 if ratio == 4 else 1
    width, num_cand, ring = c * dim, c * ratio, c * ratio + 1
    g = torch.Generator().manual_seed(seed)
    pos, req, nis, save = [], [], [], []
    for b, (p0, q) in enumerate(zip(prefix_lens, query_lens)):
        for i in range(q):
            pos += [p0 + i]
            req += [b]
            nis += [i + 1]
            save += [(p0 + i) % ring if i >= q - ring else -1]  # the last `ring` tokens only
    num_t, num_b = len(pos), len(query_lens)
    p = torch.tensor(pos, dtype=torch.long)
    cand = p[:, None] - num_cand + 1 + torch.arange(num_cand)
    entry = ((p + 1) // ratio - 1).clamp(min=0)
    epb_e, epb_s, rbi = 2, 3, 1  # entries a token block, state rows a ring block
    nb = max(-(-(p0 + q) // ratio) for p0, q in zip(prefix_lens, query_lens)) // epb_e + 1
    row_bytes = 2 * width * 4 + 16
    s_stride = 64 + epb_s * row_bytes  # a ring block: 64 bytes of another layer, then rows
    nr = rbi + -(-ring // epb_s)
    ring_ids = torch.randperm(num_b * nr + 3, generator=g)[: num_b * nr].view(num_b, nr)
    state = torch.randn(int(ring_ids.max() + 1) * s_stride // 4, generator=g)
    unit = entry_bytes(fmt, dim, rope) + 5
    e_stride, e_base = epb_e * unit + 40, 24
    blocks = torch.randperm(num_b * nb + 2, generator=g)[: num_b * nb].view(num_b, nb).int()
    cache = torch.zeros((int(blocks.max()) + 1) * e_stride, dtype=torch.uint8)
    proj = (torch.randn(num_t, 2 * width, generator=g) * 2).to(DEVICE)
    ape = torch.randn(ratio, width, generator=g).to(DEVICE)
    weight = (1 + 0.2 * torch.randn(dim, generator=g)).bfloat16().to(DEVICE)
    angles = (entry * ratio).float()[:, None] * torch.rand(rope // 2, generator=g)[None, :]
    treq = torch.tensor(req, device=DEVICE)
    paged = PagedAddress(ring_ids.to(DEVICE), blocks.to(DEVICE), treq.int(), treq,
                         (entry % epb_e).to(DEVICE), rbi, epb_s, s_stride, 64, row_bytes,
                         e_stride, unit, e_base)  # fmt: skip
    i32 = dict(dtype=torch.int32, device=DEVICE)
    per_tok = dict(
        positions=p.to(DEVICE), save_slots=torch.tensor(save, device=DEVICE),
        boundary=torch.arange(num_t, **i32), num_in_step=torch.tensor(nis, **i32),
        window_rows=torch.where(cand >= 0, cand % ring, -1).to(DEVICE),  # [T, NC] ring slots
        cos=angles.cos().to(DEVICE), sin=angles.sin().to(DEVICE),
        entry_slots=(entry // epb_e).clamp(max=nb - 1).to(DEVICE),  # block-table columns
    )  # fmt: skip
    return proj, ape, weight, per_tok, paged, state.to(DEVICE), cache.to(DEVICE)


def _pick(per_tok, paged, rows):
    """Boundary-program tables: the per-token rows of the tokens in `rows`."""
    picked = {k: (v if k in ("positions", "save_slots") else v[rows]) for k, v in per_tok.items()}
    picked["boundary"] = rows.int()
    return picked, paged._replace(reqs=paged.reqs[rows], entry_rows=paged.entry_rows[rows])


def _call(fn, kv, gate, tabs, weight, state, cache, kw, **glue):
    """`fn` on copies of the flat storages -> (state, cache) storages after it."""
    state, cache = state.clone(), cache.clone()
    fn(kv, gate, tabs["positions"], _rows(state, kv.shape[1] * 2), tabs["save_slots"],
       tabs["boundary"], tabs["num_in_step"], tabs["window_rows"], weight, tabs["cos"],
       tabs["sin"], _rows(cache, kw["unit"]), tabs["entry_slots"], ratio=kw["ratio"],
       fmt=kw["fmt"], rope_dim=kw["rope"], **glue)  # fmt: skip
    return state, cache


GLUE_CASES = [  # (ratio, dim, rope, fmt, prefix lens, query lens)
    (4, 64, 32, "fp8_ue8m0", [2, 10, 0], [2, 2, 9]),  # decodes, window 0, a chunk wrapping
    (4, 128, 64, "mxfp4", [5, 0], [9, 3]),
    (8, 64, 32, "fp8_fp32scale", [3, 13], [5, 3]),
    (128, 64, 32, "fp8_ue8m0", [127, 200], [1, 56]),
    (4, 64, 32, "fp8_ue8m0", [6], [1]),  # no boundary: the save alone
]


@pytest.mark.parametrize("always", [False, True], ids=["boundary", "always"])
@pytest.mark.parametrize(("ratio", "dim", "rope", "fmt", "prefix", "query"), GLUE_CASES)
def test_glue_in_the_kernels_is_bitwise_the_torch_glue(ratio, dim, rope, fmt, prefix, query,
                                                        always):  # fmt: skip
    """ape, the strided halves and the PagedAddress inside the kernels write the same state and
    cache bits as the torch glue run_compressor made before (gate + ape[phase], .contiguous(),
    ring_offsets, the block gather and entry offsets), and agree with the reference."""
    proj, ape, weight, per_tok, paged, state, cache = _paged_case(prefix, query, ratio, fmt, dim,
                                                                  rope, ratio + len(query))  # fmt: skip
    closes = ((per_tok["positions"] + 1) % ratio == 0).nonzero().squeeze(1)
    if always:
        fn, ref, (tabs, addr) = compressor_step_always, compressor_step_always_ref, (per_tok, paged)
    else:
        fn, ref, (tabs, addr) = compressor_step, compressor_step_ref, _pick(per_tok, paged, closes)
    n = entry_bytes(fmt, dim, rope)
    kw = dict(ratio=ratio, fmt=fmt, rope=rope, unit=paged.entry_unit)
    glue = dict(ape=ape, phase=per_tok["positions"] % ratio, paged=addr)
    kv, gate = proj.chunk(2, dim=1)  # [T, W] views of row stride 2W
    # before: the torch glue, then the kernels on contiguous kv and gate and resolved rows
    save, window, entry = addr.resolve(tabs["save_slots"], tabs["window_rows"],
                                       tabs["entry_slots"])  # fmt: skip
    old = dict(tabs, save_slots=save, window_rows=window, entry_slots=entry)
    s_old, c_old = _call(fn, kv.contiguous(), gate + ape[glue["phase"]], old, weight, state,
                         cache, kw)  # fmt: skip
    s_new, c_new = _call(fn, kv, gate, tabs, weight, state, cache, kw, **glue)
    assert torch.equal(s_new, s_old) and torch.equal(c_new, c_old)
    assert not torch.equal(s_new, state)  # the save wrote rows
    s_ref, c_ref = _call(ref, kv, gate, tabs, weight, state, cache, kw, **glue)
    assert torch.equal(s_new, s_ref)
    # entries of the programs that close a window: close to the reference; no other byte moved
    written = entry if not always else entry[closes]
    at = written.long()[:, None] + torch.arange(n, device=DEVICE)  # [NB, n] byte offsets
    if written.numel():
        _assert_entries_close(c_new[at], c_ref[at], fmt, dim, rope)
    untouched = torch.ones_like(cache, dtype=torch.bool)
    untouched[at.reshape(-1)] = False
    assert torch.equal(c_new[untouched], cache[untouched])
    assert torch.equal(c_ref[untouched], cache[untouched])
