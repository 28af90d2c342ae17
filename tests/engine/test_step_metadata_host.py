"""An eager step's metadata (the upload's int32 tables, each layer's window bases, the C4
lengths, the local block table) is built on the host and crosses in the step's one upload, yet
equals the device formulas it replaced, field by field (values, dtypes, shapes), on the
engine's own steps: one prefill alone (the stride-0 window bases), several prefills a step,
decodes beside chunked prefills. The head's sample rows (a strided view when evenly spaced)
give the logits of the gather bit for bit.

Launches are counted as on CUDA by tools/launch_counter.py's counters: the device formulas made
13 launches a step (3 casts, 7 for the window bases, 3 for the C4 lengths)."""

from __future__ import annotations

import itertools

import pytest
import torch

from dsv4.runner.paged import forward as paged_forward
from dsv4.runner.paged.forward_state import ForwardState, PagedSwitches
from dsv4.runner.paged.step_metadata import StepMetadata, StepTokens, upload
from tests.engine.conftest import greedy_request, make_core, run_to_completion
from tests.engine.test_engine_core import prompts
from tests.engine.test_step_tables_host import counted


def device_formulas(meta: StepMetadata) -> dict[str, torch.Tensor]:
    """The step's tensors as the device built them before the host tables: one int64 upload
    cast on the device, the window bases gathered and offset per token, the C4 lengths."""
    tokens, geo = meta.tokens, meta.geo
    reqs = tokens.requests
    nb = max([len(r.block_table) for r in reqs] + [1])
    tables = torch.tensor([list(r.block_table) + [0] * (nb - len(r.block_table)) for r in reqs])
    qsl = [0, *itertools.accumulate(e - s for s, e in zip(tokens.starts, tokens.ends))]
    t2r = torch.tensor(tokens.request_of_tokens())
    rings = torch.tensor([list(r.ring_block_ids) for r in reqs])
    positions = torch.tensor(tokens.host_positions)
    rbi, base = geo.window_pages(torch.device("cpu"))
    blocks = rings[t2r][:, rbi]  # [T, L]
    ring = geo.layers[0].window.slots  # the window store's ring slots (ForwardState's formula)
    keep = positions >= torch.tensor(tokens.ends)[t2r] - ring
    return {
        "token_to_req": t2r.int(), "query_start_loc": torch.tensor(qsl).int(),
        "block_tables": tables.int(), "ring_ids": rings, "positions": positions,
        "starts": torch.tensor(tokens.starts), "ends": torch.tensor(tokens.ends),
        "win_base": (blocks * geo.slots_per_block + base).T.int().contiguous(),
        "c4_lens": ((positions + 1) // 4).int(),
        "local_block_table": torch.arange(nb, dtype=torch.int32).expand(len(reqs), -1),
        "win_rel": torch.where(keep, positions % ring, -1).int(),
    }  # fmt: skip


class Recorder:
    """Wraps `PagedForward.run`: each eager step's metadata is compared to the device formulas,
    its upload and metadata rebuilt under the counters, and its head checked against the
    gather + `m.norm` head."""

    def __init__(self, monkeypatch) -> None:
        self.steps: list[tuple[int, int, int, int]] = []  # (requests, launches, uploads, syncs)
        self.sample_views = 0  # steps whose sample rows were a view
        run = paged_forward.PagedForward.run

        def recorded(forward, meta, chunk_plans=()):
            logits, x = run(forward, meta, chunk_plans)
            if meta.tokens is not None:
                self._check(forward, meta, logits, x)
            return logits, x

        monkeypatch.setattr(paged_forward.PagedForward, "run", recorded)

    def _check(self, forward, meta: StepMetadata, logits, x) -> None:
        want = device_formulas(meta)
        got = {name: getattr(meta.t, name) for name in want if hasattr(meta.t, name)}
        got |= {"win_base": meta.win_base, "c4_lens": meta.c4_lens,
                "local_block_table": meta.local_block_table}  # fmt: skip
        for name, w in want.items():
            g = got[name]
            assert g.dtype == w.dtype and g.shape == w.shape, (name, g, w)
            assert torch.equal(g, w), (name, g, w)

        def rebuild():
            ids = meta.t.token_ids.tolist()  # before the count: the host's token ids
            return lambda: StepMetadata(meta.shape, meta.tokens, upload(
                meta.tokens, ids, meta.t.positions.device, meta.geo), meta.geo, meta.kernels,
                meta.switches)  # fmt: skip

        _, c = counted(rebuild())
        launches = sum(kind != "memcpy" for kind, *_ in c.events)
        uploads = sum(e[:2] == ("memcpy", "memcpy HtoD") for e in c.events)
        self.steps.append((len(meta.tokens.requests), launches, uploads, len(c.syncs)))
        rows = meta.shape.sample_rows
        picked = forward._sample_rows(meta, x)
        self.sample_views += picked.data_ptr() == x[rows[0]].data_ptr() if rows else 0
        m, cfg = forward.model, forward.cfg
        gathered = x[torch.tensor(rows, dtype=torch.long)].contiguous()
        h = forward._ops["hc_head"](gathered, m.hc_head_fn, m.hc_head_scale, m.hc_head_base,
                                    cfg.hc_eps, cfg.rms_norm_eps)  # fmt: skip
        assert torch.equal(logits, m.head(m.norm(h)).float())


@pytest.mark.parametrize("budget", [4096, 64, 20], ids=["whole", "chunks-64", "chunks-20"])
def test_host_metadata_equals_the_device_formulas(tiny, monkeypatch, budget) -> None:
    """Whole prompts: every prefill in the first step; chunks of 64 / 20 tokens: decodes
    beside prefill chunks in the later steps."""
    rec = Recorder(monkeypatch)
    core = make_core(tiny, budget=budget, paged={}, max_num_seqs=4)
    for rid, prompt in prompts(tiny.cfg.vocab_size).items():
        core.add_request(greedy_request(rid, prompt, 4))
    run_to_completion(core)
    assert rec.steps and any(n > 1 for n, *_ in rec.steps)
    for n, launches, uploads, syncs in rec.steps:
        # one gather of the window bases (none for one request); nothing read back
        assert launches <= (n > 1) and uploads == 1 and syncs == 0, rec.steps
    assert rec.sample_views > 0


def test_one_prefill_takes_no_launch(tiny, monkeypatch) -> None:
    """One prompt alone: its window bases are a stride-0 view of the uploaded [L, 1] rows."""
    rec = Recorder(monkeypatch)
    core = make_core(tiny, paged={})
    core.add_request(greedy_request("solo", prompts(tiny.cfg.vocab_size)["r0"], 2))
    run_to_completion(core)
    assert rec.steps and all(launches == 0 for _, launches, *_ in rec.steps), rec.steps


def test_upload_without_geometry_keeps_the_device_path(tiny) -> None:
    """`upload` without the geometry (the MTP passes' eager steps) leaves the host tables out;
    `StepMetadata` then builds them on the device, same values."""
    core = make_core(tiny, paged={})
    core.add_request(greedy_request("a", prompts(tiny.cfg.vocab_size)["r0"], 1))
    batch = core.scheduler.schedule()
    forward = core.runner.forward.paged
    tokens = StepTokens.of(batch.requests)
    ids = [i for r in batch.requests for i in r.token_ids]
    metas = [StepMetadata(tokens.shape, tokens, upload(tokens, ids, forward.device, geo),
                          forward.geo, forward.kernels, forward.metadata)
             for geo in (None, forward.geo)]  # fmt: skip
    assert metas[0].t.c4_lens is None and metas[1].t.c4_lens is not None
    for name in ("win_base", "c4_lens", "local_block_table"):
        assert torch.equal(getattr(metas[0], name), getattr(metas[1], name)), name
    # the window store's ring slots: the device formula without the host table
    assert metas[0].t.win_rel is None and metas[1].t.win_rel is not None
    g = forward.geo.layers[0]
    (rel0, ok0), (rel1, ok1) = (ForwardState(m, (), PagedSwitches(), None).window_slots(g)
                                for m in metas)  # fmt: skip
    assert rel0.dtype == rel1.dtype == torch.int32 and torch.equal(rel0, rel1) and ok0 == ok1
