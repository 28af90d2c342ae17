"""Prefill chunk tables (dsv4/runner/paged/prefill.py) are built without reading anything back
from the device: no boolean-mask selection, no nonzero, no .item(). On a GPU each such read is a
stream sync in the middle of the forward (five a ratio kind before; a 1024-token prefill step of
the 4-layer Flash slice had 20 syncs and a third of its wall time outside kernels on an H100).
The CPU run records the aten ops that sync on CUDA while the tables are built, through the
engine's own steps (chunked prompts, several requests a chunk, decodes beside them)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.runner.paged import forward_state
from tests.engine.conftest import greedy_request, make_core, run_to_completion
from tests.engine.test_engine_core import prompts

# aten ops that read a device value back to the host (a CUDA stream sync)
SYNCING = {"aten.nonzero.default", "aten._local_scalar_dense.default",
           "aten.masked_select.default", "aten.item.default", "aten.is_nonzero.default"}  # fmt: skip


class _SyncingOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        masks = [a for a in args if isinstance(a, (list, tuple))]
        bool_index = name.startswith("aten.index") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for m in masks for t in m
        )
        if name in SYNCING or bool_index:
            self.found.append(name)
        return func(*args, **(kwargs or {}))


def test_chunk_tables_read_nothing_back(tiny, monkeypatch) -> None:
    built = []

    def recorded(meta, ratio, chunk):
        mode = _SyncingOps()
        with mode:
            tables = original(meta, ratio, chunk)
        built.append((ratio, mode.found))
        return tables

    original = forward_state.chunk_tables
    monkeypatch.setattr(forward_state, "chunk_tables", recorded)
    core = make_core(tiny, budget=64, paged={}, max_num_seqs=4)
    for rid, prompt in prompts(tiny.cfg.vocab_size).items():
        core.add_request(greedy_request(rid, prompt, 4))
    run_to_completion(core)
    assert {ratio for ratio, _ in built} >= {4, 128}, built  # both compressed kinds were built
    assert all(not found for _, found in built), [b for b in built if b[1]]
