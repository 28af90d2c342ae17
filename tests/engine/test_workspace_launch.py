"""The paged forward's one-launch prefill workspaces (`kernels.kv_workspace`, the window ring
store in the first launch of a layer when no workspace reads a slot it stores) equal the path
they replace (`kv_rows` gathers, scratch round trip, index_puts, then `store_window`'s store)
bit for bit: every workspace row a source names, the whole cache after every step, the tokens.

The served lossy formats (fp8 KV, MXFP4 indexer keys), chunks of 50 tokens: a fresh chunk (no
window prefix: the store fused), later chunks whose prefix and stored rows share ring slots
(stored apart), several requests a step beside decodes (one store for them all); the three
KV row ops on their Triton kernels (interpreter on CPU) or all on the torch references.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.runner.paged import attention as paged_attention
from dsv4.runner.paged import forward_state, kv_rows
from kernels.backend import KernelBackendConfig
from tests.engine.conftest import greedy_request, make_core
from tests.engine.test_chunk_invariance import lossy_prompts
from tests.leak import assert_no_leaks

ROW_OPS = {"kv_workspace": "triton", "kv_store": "triton", "kv_gather": "triton"}


def _serve(model, kernels, monkeypatch, fused: bool):
    """(per step: the named workspace rows of every layer and chunk, the cache bytes after the
    step; the tokens; how many layer-steps stored in a workspace launch and apart)."""
    with monkeypatch.context() as m:
        if not fused:  # the op unregistered: the reference path
            m.setattr(kv_rows, "workspace_op", lambda kernels, device: None)
        workspaces, claims = [], []
        workspace, claim = paged_attention._workspace, forward_state.ForwardState.claim_window_store

        def spy(fs, g, chunk, kv):
            ws = workspace(fs, g, chunk, kv)
            named = (chunk.ws_src >= 0).any(0)  # padding rows stay uninitialised on the old path
            workspaces.append(ws[named])
            return ws

        def claimed(fs, g):
            rel = claim(fs, g)
            claims.append(rel is not None)
            return rel

        m.setattr(paged_attention, "_workspace", spy)
        m.setattr(forward_state.ForwardState, "claim_window_store", claimed)
        core = make_core(model, kv="fp8", index="mxfp4", budget=50, paged={}, kernels=kernels,
                         max_num_seqs=4)  # fmt: skip
        for i, prompt in enumerate(lossy_prompts(model.cfg.vocab_size)):
            core.add_request(greedy_request(f"r{i}", prompt, 3))
        steps, out = [], {}
        while core.has_work():
            workspaces.clear()
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
            steps.append((list(workspaces), core.runner.cache.backing.clone()))
        assert_no_leaks(core)
    return steps, out, claims


@pytest.mark.slow
@pytest.mark.parametrize("kernels", [KernelBackendConfig(default="ref", overrides=ROW_OPS),
                                     KernelBackendConfig(default="ref")],
                         ids=["triton", "ref"])  # fmt: skip
def test_one_launch_workspaces_equal_the_gathered_ones(tiny, monkeypatch, kernels) -> None:
    new_steps, new_tokens, claims = _serve(tiny, kernels, monkeypatch, fused=True)
    old_steps, old_tokens, old_claims = _serve(tiny, kernels, monkeypatch, fused=False)
    assert new_tokens == old_tokens and len(new_steps) == len(old_steps)
    assert not old_claims and True in claims and False in claims  # stored in and apart
    for (new_ws, new_cache), (old_ws, old_cache) in zip(new_steps, old_steps):
        assert len(new_ws) == len(old_ws)
        for a, b in zip(new_ws, old_ws):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert torch.equal(new_cache, old_cache)
