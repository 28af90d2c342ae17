"""Decode graphs are captured with no Python garbage collection inside a capture
(`dsv4.runner.paged.graphs.collector_paused`).

The pooled halves128 GPU case of test_expert_pool.py (run after the other pooled cases) failed
its capture with "operation failed due to a previous error during capture" at `copy_wait_end`,
right after the copy kernel's launch had succeeded: nothing between them talks to the driver
but Python. The likely cause (the GPU test below tells): a dropped expert pool is cyclic
garbage (`LayerPool.owner_pool` <-> `ExpertPool.layers`) that keeps its registered host rows;
when the collector ran inside the capture their finalizer called cudaHostUnregister there,
which invalidates a global-mode capture while the finalizer drops the error.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch

from dsv4.model.tiny import random_model
from dsv4.runner.paged import PoolOptions, pool_experts
from dsv4.runner.paged.graphs import StaticInputs, StaticPass, StepRow, collector_paused
from kernels.backend import KernelBackendConfig
from tests.engine.test_expert_pool import CFG, _pooled

KEY = (1, 8)  # (batch, context): the one captured key


def _static_pass(step, device: str) -> StaticPass:
    inputs = StaticInputs(1, 1, 1, [0], 0, torch.device(device))
    return StaticPass(step, inputs, (KEY[0],), (KEY[1],), None, torch.float32, True)


def _dropped_pool(device: str = "cpu") -> weakref.ref:
    """A weak reference to an expert pool whose model and pool were dropped: cyclic garbage."""
    if device == "cpu":
        _, pool = _pooled(random_model(CFG, seed=21))
    else:
        model = random_model(CFG, seed=21, dtype=torch.bfloat16, device=device)
        options = PoolOptions((6,), cache_slots=1, max_decode_tokens=2)
        pool = pool_experts(model, options, device, KernelBackendConfig(default="triton"))
        del model
    ref = weakref.ref(pool)
    del pool
    return ref


def _fake_graph_api(monkeypatch, capturing: list) -> None:
    """torch.cuda's stream and graph calls that `StaticPass.capture` makes, on CPU: `capturing`
    is non-empty inside the fake capture."""

    class Stream:
        def wait_stream(self, other) -> None:
            pass

    class Graph:
        def pool(self) -> str:
            return "pool"

    @contextlib.contextmanager
    def graph(g, pool=None):
        capturing.append(g)
        yield
        capturing.pop()

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)


def test_a_dropped_pool_is_freed_before_the_capture_and_none_is_collected_inside(
    monkeypatch,
) -> None:
    """The capture collects first (the dropped pool and its host rows go before it begins) and
    captures with the automatic collector off; the collector's state is restored after."""
    capturing, seen = [], []
    _fake_graph_api(monkeypatch, capturing)

    def step(shape, t, select, streams):
        if capturing:
            seen.append((gc.isenabled(), pool_ref() is None))
        return (t.positions.float() * 2,)

    enabled = gc.isenabled()
    gc.disable()  # only the capture's own collection may free the pool
    try:
        pool_ref = _dropped_pool()
        assert pool_ref() is not None  # garbage, but only the cyclic collector frees it
        _static_pass(step, "cpu").capture(None)
        assert not gc.isenabled()  # the state it found
    finally:
        if enabled:
            gc.enable()
    assert seen == [(False, True)]
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled() == enabled


@pytest.mark.gpu
def test_a_dropped_pool_with_registered_host_rows_does_not_break_a_capture() -> None:
    """On the GPU: a dropped pool's registered host rows, and a collection inside the capture
    (the step calls it where the automatic collector may run). Without `collector_paused`
    their cudaHostUnregister runs in the capture and it fails as the halves128 case did."""
    torch.zeros(1, device="cuda")

    def step(shape, t, select, streams):
        if torch.cuda.is_current_stream_capturing():
            gc.collect()
        return (t.positions * 2,)

    enabled = gc.isenabled()
    gc.disable()  # the pool stays garbage until the capture (or its collection before it)
    try:
        pool_ref = _dropped_pool("cuda")
        static = _static_pass(step, "cuda")
        static.capture(None)
    finally:
        if enabled:
            gc.enable()
    assert pool_ref() is None
    out = static.run(KEY, [StepRow((5,), 3, (0,), ())])
    assert out[0][:1].tolist() == [6]
