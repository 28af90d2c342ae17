"""Decode host work off the critical path (issue 25): the switches on give the slow path's tokens.

- `GraphOptions.greedy_argmax` / `features.greedy_in_graph`: an all-greedy graph step's tokens
  come from the argmax the static pass computes, not from the sampler;
- `features.async_scheduling`: the next decode step is scheduled and launched before the
  current one's tokens reach the host, and fed them on the device.

On CPU the decode passes run as static eager steps (`capture=False`): the same code as the
captured graphs. Workloads mix greedy and sampled requests, lengths that end mid-batch, a
stop id, a stop checker (what stop strings go through) and an abort while a step is launched.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.runner.paged.decode_graphs import GraphOptions
from dsv4.scheduler.request import Request
from dsv4.types import SamplingParams
from tests.engine.conftest import make_core, run_to_completion
from tests.leak import assert_no_leaks

GREEDY = GraphOptions(max_batch=4, max_model_len=2048, capture=False, greedy_argmax=True)
SLOW = GraphOptions(max_batch=4, max_model_len=2048, capture=False)


def _prompts(vocab: int, n: int) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(11)
    lengths = (3, 40, 90, 17, 60)[:n]
    return [tuple(torch.randint(2, vocab, (m,), generator=gen).tolist()) for m in lengths]


def _stop_after_five(request: Request, new_ids: tuple[int, ...]) -> bool:
    """A stop checker the scheduler cannot foresee: r1 ends at its fifth token."""
    return request.request_id == "r1" and len(request.output_token_ids) >= 5


def _core(model, graphs: GraphOptions, async_scheduling: bool = False):
    return make_core(model, budget=64, paged={}, graphs=graphs, max_num_seqs=4,
                     async_scheduling=async_scheduling, stop_checker=_stop_after_five)  # fmt: skip


def _run(core, model, *, sampled: bool, stop_id: int | None = None,
         abort_at: int | None = None) -> dict[str, list[int]]:  # fmt: skip
    """r0..r3 greedy with 4..14 new tokens (r1 stopped by the checker, r2 by `stop_id`); with
    `sampled`, r4 samples (seeded) beside them. `abort_at`: abort r3 after that many steps."""
    prompts = _prompts(model.cfg.vocab_size, 5 if sampled else 4)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.9, top_k=20, seed=5) if i == 4 else None
        stops = {stop_id} if i == 2 and stop_id is not None else set()
        core.add_request(Request(f"r{i}", prompt, max_new_tokens=(14, 12, 10, 4, 9)[i],
                                 sampling_params=params, stop_token_ids=frozenset(stops)))  # fmt: skip
    outputs: dict[str, list[int]] = {}
    for n in range(500):
        if not core.has_work():
            break
        if n == abort_at:
            assert core.has_step_in_flight == core.async_scheduling  # r3 is in it
            core.abort("r3")
        for out in core.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert_no_leaks(core)
    return outputs


@pytest.fixture(scope="module")
def slow(tiny) -> dict[str, list[int]]:
    return _run(_core(tiny, SLOW), tiny, sampled=False)


def test_greedy_in_graph_gives_the_sampler_tokens(tiny, slow) -> None:
    core = _core(tiny, GREEDY)
    assert _run(core, tiny, sampled=False) == slow
    assert core.runner.forward.num_greedy_in_graph >= 8
    assert len(slow["r1"]) == 5 and len(slow["r3"]) == 4


def test_greedy_in_graph_off_on_the_same_graphs(tiny, slow) -> None:
    """The benchmark's A/B: graphs with the argmax, the runner told not to use it."""
    core = _core(tiny, GREEDY)
    core.runner.forward.greedy_in_graph = False
    assert _run(core, tiny, sampled=False) == slow
    assert core.runner.forward.num_greedy_in_graph == 0


def test_sampled_rows_keep_the_sampler(tiny) -> None:
    """A step with a sampled row samples every row (same draws as without the switch)."""
    want = _run(_core(tiny, SLOW), tiny, sampled=True)
    for async_scheduling in (False, True):
        core = _core(tiny, GREEDY, async_scheduling)
        assert _run(core, tiny, sampled=True) == want


def test_async_scheduling_gives_the_same_tokens(tiny, slow) -> None:
    core = _core(tiny, GREEDY, async_scheduling=True)
    assert _run(core, tiny, sampled=False) == slow
    assert core.num_steps_ahead >= 5
    assert core.num_steps_ahead <= core.runner.forward.num_greedy_in_graph


def test_async_scheduling_stop_id_and_abort(tiny, slow) -> None:
    """A stop id found at step N drops the request's step N + 1 (launched already); an abort
    while a step is launched ahead drops its token there too; no block leaks (checked)."""
    stop_id = slow["r2"][3]
    cut = slow["r2"].index(stop_id) + 1
    want = _run(_core(tiny, SLOW), tiny, sampled=False, stop_id=stop_id, abort_at=5)
    assert len(want["r2"]) == cut and len(want["r3"]) == 3  # aborted before its 4th token
    core = _core(tiny, GREEDY, async_scheduling=True)
    got = _run(core, tiny, sampled=False, stop_id=stop_id, abort_at=5)
    assert got == want and core.num_steps_ahead > 0


def test_abort_while_a_step_runs_ahead(tiny, slow) -> None:
    core = _core(tiny, GREEDY, async_scheduling=True)
    prompts = _prompts(tiny.cfg.vocab_size, 2)
    for i, prompt in enumerate(prompts):
        core.add_request(Request(f"r{i}", prompt, max_new_tokens=14, eos_token_id=None))
    while not core.has_step_in_flight:
        core.step()
    core.abort("r0")
    core.abort("r1")
    assert core.has_work()  # the launched step still has to finish
    assert run_to_completion(core) == {}
    assert not core.has_work()
    assert_no_leaks(core)


def test_async_scheduling_runs_only_where_its_steps_can() -> None:
    """On by default; without graphs, greedy_in_graph or with several ranks it has no effect
    (a prefill worker runs without graphs and the same defaults), never a config error."""
    from dsv4.config import load_config
    from dsv4.worker.options import engine_async_scheduling

    assert load_config({}).features.async_scheduling
    no_graphs = load_config({"features.cuda_graphs": False, "features.greedy_in_graph": False})
    assert no_graphs.features.async_scheduling  # accepted, inert
    cuda = {"model.device": "cuda", "features.forward": "paged"}  # only read, never built here
    assert engine_async_scheduling(load_config(cuda), ranks=None)
    assert not engine_async_scheduling(load_config(cuda), ranks=object())
    off = load_config({**cuda, "features.greedy_in_graph": False})
    assert not engine_async_scheduling(off, ranks=None)
    assert not engine_async_scheduling(load_config({}), ranks=None)  # CPU: no decode graphs
    prefill = load_config({**cuda, "worker.role": "prefill"})
    assert not engine_async_scheduling(prefill, ranks=None)


def test_async_engine_streams_with_steps_ahead(tiny, slow) -> None:
    """The engine thread with async scheduling: the same streams; a command (a request added
    while a step is launched ahead) runs only after that step is drained."""
    import asyncio

    from dsv4.engine.async_engine import AsyncEngine

    prompts = _prompts(tiny.cfg.vocab_size, 4)

    async def main() -> dict[str, list[int]]:
        engine = AsyncEngine(_core(tiny, GREEDY, async_scheduling=True))
        engine.start()

        async def one(i: int) -> tuple[str, list[int]]:
            got = []
            request = Request(f"r{i}", prompts[i], max_new_tokens=(14, 12, 10, 4)[i])
            async for out in engine.generate(request):
                got.extend(out.new_token_ids)
            return f"r{i}", got

        try:
            got = dict(await asyncio.gather(*(one(i) for i in range(4))))
            assert engine.core.num_steps_ahead > 0
            return got
        finally:
            await engine.stop()
            assert_no_leaks(engine.core)

    got = asyncio.run(asyncio.wait_for(main(), timeout=120))
    # the four arrive one command apart: batches differ from `slow`'s, tokens must not
    assert got == slow


@pytest.mark.gpu
def test_captured_greedy_and_async_steps_match_the_sampler_on_the_gpu() -> None:
    """Captured graphs (fp8 KV, MXFP4 keys, Triton): the sampler on the graph's logits, the
    in-graph argmax, and async scheduling (tokens fed from the static argmax buffer that the
    next replay overwrites) give the same tokens; requests end mid-batch."""
    from dataclasses import replace

    from dsv4.config.model import tiny_config
    from dsv4.model.tiny import random_model
    from kernels.backend import KernelBackendConfig

    cfg = tiny_config().with_overrides(num_nextn_predict_layers=0)
    model = random_model(cfg, seed=5, dtype=torch.bfloat16, device="cuda")
    kernels = KernelBackendConfig(default="triton")
    captured = GraphOptions(max_batch=4, max_model_len=1024, greedy_argmax=True)
    gen = torch.Generator().manual_seed(2)
    plist = [torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist() for n in (1, 130, 300)]
    outs = []
    for graphs, ahead in ((replace(captured, greedy_argmax=False), False), (captured, False),
                          (captured, True)):  # fmt: skip
        core = make_core(model, kv="fp8", index="mxfp4", budget=512, paged={}, kernels=kernels,
                         graphs=graphs, max_num_seqs=4, async_scheduling=ahead)  # fmt: skip
        for i, p in enumerate(plist):
            core.add_request(Request(f"r{i}", tuple(p), max_new_tokens=(16, 9, 12)[i]))
        outs.append(run_to_completion(core))
        forward = core.runner.forward
        assert forward.graphs.num_graphs > 0 and forward.graphs.passes["target"].num_runs >= 8
        assert (forward.num_greedy_in_graph > 0) == graphs.greedy_argmax
        assert (core.num_steps_ahead > 0) == ahead
        assert_no_leaks(core)
    assert outs[0] == outs[1] == outs[2]
