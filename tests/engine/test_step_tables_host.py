"""The per-step index tables of the paged forward (compressor tables, prefill chunk tables) are
built on the host and cross in one upload, yet equal the device formulas they replace, field
by field (values, dtypes, shapes), on the engine's own steps: several requests a chunk, chunked
prompts with a window prefix shorter and longer than the window, decodes beside prefills, MTP
drafts (the ring keeps k more slots), ratios 4 and 128, boundary-only and every-token
compressor programs, and the static decode passes (no host positions: the device formulas).

Their launches are bounded, counted as on CUDA by tools/launch_counter.py's counters: the old
formulas made ~36 launches per compressor ratio kind and 21-33 per chunk table."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from dsv4.runner.paged import forward_state
from dsv4.runner.paged.compress import CompressorTables, _device_tables, paged_address
from dsv4.runner.paged.decode_graphs import GraphOptions
from dsv4.runner.paged.forward_state import PagedSwitches
from dsv4.runner.paged.prefill import ChunkTables
from kernels.backend import KernelBackendConfig
from tests.engine.conftest import greedy_request, make_core, run_to_completion
from tests.engine.test_engine_core import prompts
from tests.engine.test_speculative import mtp_model  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("launch_counter", ROOT / "tools/launch_counter.py")
lc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lc)

STATIC = GraphOptions(max_batch=4, max_model_len=2048, capture=False)
# launches of one build, as on CUDA: cos, sin (the kernels read the entries' blocks)
MAX_COMPRESSOR_LAUNCHES = 2
# a static pass: cos, sin (its one Triton launch is counted by tools/launch_count.py)
MAX_STATIC_COMPRESSOR_LAUNCHES = 2
# window candidates' gather; C128: its columns (lt, add, where, cat); the entries' blocks are
# read on the host (were a gather + an offset on the device)
MAX_CHUNK_LAUNCHES = {0: 1, 4: 1, 128: 5}


def reference_compressor_tables(meta, ratio: int, all_tokens: bool) -> CompressorTables:
    """The device formulas before the host tables: every token's are what captured steps still
    build (`compress._device_tables`, the formulas of 46a8ca1 with the entry's block-table
    column kept in place of the block it indexes); boundary-only programs are the
    rows of those whose position closes a window ((p + 1) % ratio == 0, from the host
    positions as before), with the per-token save slots and phases as they are."""
    every = _device_tables(meta, ratio)
    if all_tokens:
        return every
    positions = meta.shape.host_positions
    host = [i for i, p in enumerate(positions) if (p + 1) % ratio == 0]
    rows = torch.tensor(host, dtype=torch.long, device=meta.t.positions.device)
    picked = {f.name: getattr(every, f.name)[rows] for f in dataclasses.fields(every)
              if f.name not in ("ratio", "all_tokens", "save_slots", "phase")}  # fmt: skip
    return dataclasses.replace(every, all_tokens=False, **picked)


def reference_chunk_tables(meta, ratio: int, chunk) -> ChunkTables:
    """The device formulas before the host tables (dsv4/runner/paged/prefill.py at 46a8ca1)."""
    tokens, t = meta.tokens, meta.t
    w, dev = meta.geo.layout.model.sliding_window, t.positions.device
    first = tokens.num_decode_requests + chunk.start
    reqs = range(first, first + chunk.num_requests)
    starts = torch.tensor([tokens.starts[b] for b in reqs])
    ends = torch.tensor([tokens.ends[b] for b in reqs])
    n_comp = ends // ratio if ratio else torch.zeros_like(ends)
    prefix = starts.clamp(max=w - 1)
    big_n = max(chunk.max_compressed_len, int(n_comp.max()))
    m = big_n + max(chunk.max_gather_len, int((prefix + ends - starts).max()))
    lo = tokens.first_token[first]
    hi = lo + int((ends - starts).sum())
    # the gathered rows by boolean masks over [R, max] (the order the old host indices kept)
    k_comp = torch.arange(max(int(n_comp.max()), 1))
    r_comp, i_comp = (k_comp[None, :] < n_comp[:, None]).nonzero(as_tuple=True)
    j_all = torch.arange(max(int(prefix.max()), 1))
    r_win, j_win = (j_all[None, :] < prefix[:, None]).nonzero(as_tuple=True)
    epb = meta.geo.layout.block_size // max(ratio, 1)
    bt = t.block_tables.long()
    blocks = bt[r_comp + first, (i_comp // epb).clamp(max=bt.shape[1] - 1)]
    comp_src = blocks * meta.geo.slots_per_block + i_comp % epb
    ring_slots = meta.geo.layers[0].window.slots
    win_src = (starts[r_win] - prefix[r_win] + j_win) % ring_slots
    first_tok = torch.tensor([tokens.first_token[b] for b in reqs])
    base = torch.arange(chunk.num_requests, device=dev) * m
    treq = t.token_to_req[lo:hi].long() - first
    p = t.positions[lo:hi]
    own0 = base[treq] + big_n + prefix[treq] - starts[treq]
    q = p[:, None] - w + 1 + torch.arange(w, device=dev)
    cand = torch.where(q >= 0, own0[:, None] + q, -1)
    if ratio == 128:
        k = torch.arange(max(int(n_comp.max()), 1), device=dev)
        vis = k[None, :] < ((p + 1) // 128)[:, None]
        cand = torch.cat((cand, torch.where(vis, base[treq][:, None] + k, -1)), dim=1)
    comp_dst, win_dst, query_dst = r_comp * m + i_comp, r_win * m + big_n + j_win, own0 + p
    ws_src = torch.full((2, chunk.num_requests * m), -1, dtype=torch.int32, device=dev)
    ws_src[0, comp_dst] = comp_src.int()  # kv_workspace's sources: (slot, tok) of each row
    ws_src[0, win_dst], ws_src[1, win_dst] = win_src.int(), first_tok[r_win].int()
    ws_src[1, query_dst] = torch.arange(lo, hi, dtype=torch.int32, device=dev)
    return ChunkTables(lo, hi, chunk.num_requests * m, comp_src, comp_dst, win_src,
                       first_tok[r_win], win_dst, query_dst, base[treq], cand.int(),
                       ws_src)  # fmt: skip


def assert_same_tables(new, old) -> None:
    for f in dataclasses.fields(old):
        a, b = getattr(new, f.name), getattr(old, f.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, (f.name, a, b)
            assert torch.equal(a, b), (f.name, a, b)
        else:
            assert a == b, (f.name, a, b)


def counted(build, *args, **kwargs):
    """(what `build` returns, its launch_counter events and syncs) as on CUDA: the step's device
    tensors are older than the count, so device-resident; host arrays are not."""
    c = lc.LaunchCounter()
    with lc.Residency(c), lc.Launches(c):
        c.counting = True
        try:
            out = build(*args, **kwargs)
        finally:
            c.counting = False
    return out, c


class Recorder:
    """Wraps forward_state's builders: each build is compared to the old formulas, then built
    again under the counters (the first build warmed the host caches)."""

    def __init__(self, monkeypatch) -> None:
        self.comp: list[tuple] = []  # (ratio, all_tokens, host path, launches, uploads, syncs)
        self.chunks: list[tuple] = []  # (ratio, chunk tokens, launches, uploads, syncs)
        comp, chunk = forward_state.compressor_tables, forward_state.chunk_tables
        monkeypatch.setattr(forward_state, "compressor_tables", self._comp(comp))
        monkeypatch.setattr(forward_state, "chunk_tables", self._chunk(chunk))

    def _comp(self, original):
        def build(meta, ratio, *, all_tokens):
            tables = original(meta, ratio, all_tokens=all_tokens)
            old = reference_compressor_tables(meta, ratio, all_tokens)
            assert_same_tables(tables, old)
            compressors = _compressors(meta, ratio)
            assert compressors
            block = meta.t.block_tables.long()[old.reqs, old.entry_col]  # 46a8ca1's gather
            for g in compressors:  # each compressor's entry addresses, as the kernels form them
                want = block * g.entry_stride + old.entry_row * g.entry_unit + g.entry_base
                paged = paged_address(meta, g, tables)
                got = paged.resolve(tables.save_slots, tables.cand_slots, tables.entry_col)[2]
                assert torch.equal(got, want)
            _, c = counted(original, meta, ratio, all_tokens=all_tokens)
            host = meta.shape.host_positions is not None
            self.comp.append((ratio, all_tokens, host, *_costs(c)))
            return tables

        return build

    def _chunk(self, original):
        def build(meta, ratio, chunk):
            tables = original(meta, ratio, chunk)
            assert_same_tables(tables, reference_chunk_tables(meta, ratio, chunk))
            _, c = counted(original, meta, ratio, chunk)
            self.chunks.append((ratio, tables.token_hi - tables.token_lo, *_costs(c)))
            return tables

        return build


def _compressors(meta, ratio: int) -> list:
    layers = [g for g in meta.geo.layers if g.ratio == ratio]
    return [c for g in layers for c in (g.compressor, g.indexer) if c is not None]


def _costs(c) -> tuple[int, int, int]:
    """(launches, host->device copies, host syncs) of one counted build."""
    launches = sum(kind != "memcpy" for kind, *_ in c.events)
    uploads = sum(e[:2] == ("memcpy", "memcpy HtoD") for e in c.events)
    return launches, uploads, len(c.syncs)


def _run(core, vocab: int) -> None:
    for rid, prompt in prompts(vocab).items():
        core.add_request(greedy_request(rid, prompt, 4))
    run_to_completion(core)


@pytest.mark.parametrize(
    "budget,switches", [(64, PagedSwitches()), (20, PagedSwitches()),
                        (64, PagedSwitches(compressor_boundary_only=False))],
    ids=["chunks-64", "chunks-20", "every-token-programs"],
)  # fmt: skip
def test_eager_tables_equal_the_device_formulas_in_few_launches(tiny, monkeypatch, budget,
                                                                 switches) -> None:  # fmt: skip
    """Chunks of 64 tokens: window prefixes of 64.. (>= W - 1 = 31); of 20: prefixes 20 (< 31)
    and 40.. (>= 31). Prompts 130 and 300 cross C128 windows; every step after the first has
    decodes beside the prefill chunks."""
    rec = Recorder(monkeypatch)
    core = make_core(tiny, budget=budget, paged={"switches": switches}, max_num_seqs=4)
    _run(core, tiny.cfg.vocab_size)
    assert {r[0] for r in rec.comp} == {4, 128} and {r[0] for r in rec.chunks} == {0, 4, 128}
    assert all(host for _, _, host, *_ in rec.comp)  # eager steps: the host path
    assert any(n > 1 for _, n, *_ in rec.chunks)  # chunks of several tokens
    for *_, launches, uploads, syncs in rec.comp:
        assert launches <= MAX_COMPRESSOR_LAUNCHES and uploads == 1 and syncs == 0, rec.comp
    for ratio, _, launches, uploads, syncs in rec.chunks:
        assert launches <= MAX_CHUNK_LAUNCHES[ratio] and uploads == 1 and syncs == 0, rec.chunks


def test_static_decode_keeps_the_device_formulas(tiny, monkeypatch) -> None:
    """The static decode passes (what CUDA graphs replay: no host positions) build every-token
    tables from the device tensors alone: no upload, no sync; eager prefill steps beside."""
    rec = Recorder(monkeypatch)
    on_kernel = KernelBackendConfig(overrides={"compressor_tables": "triton"})
    core = make_core(tiny, budget=64, paged={}, graphs=STATIC, max_num_seqs=4, kernels=on_kernel)
    _run(core, tiny.cfg.vocab_size)
    static = [r for r in rec.comp if not r[2]]
    assert static and all(all_tokens for _, all_tokens, *_ in static)
    assert all(uploads == 0 and syncs == 0 for *_, uploads, syncs in static), static
    # kernels.step_tables (one Triton launch), then cos and sin (the torch formulas made 31)
    assert all(launches <= MAX_STATIC_COMPRESSOR_LAUNCHES for *_, launches, _, _ in static), static
    assert any(r[2] for r in rec.comp)  # the prefill steps took the host path


def test_static_decode_on_the_step_table_kernels_gives_the_reference_tokens(tiny) -> None:
    """The static decode passes with kernels.step_tables' Triton launches (interpreter) give the
    tokens of the same passes on the torch formulas: the kernels' tables, in the engine."""
    outputs = []
    for backend in ("ref", "triton"):
        kernels = KernelBackendConfig(
            overrides={"compressor_tables": backend, "window_tables": backend}
        )
        core = make_core(tiny, budget=64, paged={}, graphs=STATIC, max_num_seqs=4,
                         kernels=kernels)  # fmt: skip
        for rid, prompt in prompts(tiny.cfg.vocab_size).items():
            core.add_request(greedy_request(rid, prompt, 8))
        outputs.append(run_to_completion(core))
    assert outputs[0] == outputs[1]


def test_tables_with_drafts_equal_the_device_formulas(mtp_model, monkeypatch) -> None:  # noqa: F811
    """MTP k = 2: decodes of 1 + k tokens a request, a state ring of c*r + k slots."""
    rec = Recorder(monkeypatch)
    core = make_core(mtp_model, budget=64, paged={}, spec_tokens=2, max_num_seqs=8)
    _run(core, mtp_model.cfg.vocab_size)
    assert {r[0] for r in rec.comp} >= {4, 128} and rec.chunks
    for *_, launches, uploads, syncs in rec.comp:
        assert launches <= MAX_COMPRESSOR_LAUNCHES and uploads == 1 and syncs == 0, rec.comp
