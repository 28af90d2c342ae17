"""The paged forward's compressor and router weights are the model's own bytes: the stacked
wkv|wgate matrix is what the module's two weights view, the router weight is the parameter,
so the memory plan has nothing to add for them. Their fp32 math (`linear_fp32`) multiplies the
bf16 values directly: on the CPU it is the upcast GEMM bit for bit; on a GPU a tensor-core GEMM
with fp32 output, whose products are exact (only the summation order differs)."""

from __future__ import annotations

import pytest
import torch

from dsv4.config.model import tiny_config
from dsv4.model.layers import linear_fp32
from dsv4.model.tiny import random_model
from dsv4.plan import PlanRequest, plan_memory
from dsv4.runner.paged.weights import prepare_weights


def test_prepare_weights_makes_no_copy_of_compressor_or_router_weights() -> None:
    cfg = tiny_config()
    model = random_model(cfg, seed=0, dtype=torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights = prepare_weights(model)
    assert len(weights) == cfg.num_hidden_layers + (1 if cfg.has_mtp else 0)
    params = {p.data_ptr() for p in model.parameters()}
    blocks = (*model.layers, *model.mtp)
    for block, layer in zip(blocks, weights, strict=True):
        assert layer.gate_weight.data_ptr() == block.ffn.gate.weight.data_ptr()
        comps = (block.attn.compressor, getattr(block.attn.indexer, "compressor", None))
        for comp, stacked in zip(comps, (layer.compressor, layer.indexer_compressor), strict=True):
            assert (comp is None) == (stacked is None)
            if comp is None:
                continue
            n = comp.wkv.weight.shape[0]
            assert stacked.proj.dtype == torch.bfloat16
            assert comp.wkv.weight.data_ptr() == stacked.proj.data_ptr() in params
            assert comp.wgate.weight.data_ptr() == stacked.proj[n:].data_ptr()
    # the values did not move, and a second paged forward over the model shares the matrices
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    again = prepare_weights(model)
    for a, b in zip(weights, again, strict=True):
        if a.compressor is not None:
            assert a.compressor.proj.data_ptr() == b.compressor.proj.data_ptr()
    request = PlanRequest(cfg, gpu_mem_gib=8.0, max_model_len=256, max_num_seqs=2,
                          max_num_batched_tokens=64)  # fmt: skip
    assert not any("fp32" in b.name for b in plan_memory(request).buffers)


def test_linear_fp32_on_bf16_is_the_upcast_gemm_on_the_cpu() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g).bfloat16()
    w = torch.randn(24, 64, generator=g).bfloat16()
    y = linear_fp32(x, w)
    assert y.dtype == torch.float32 and y.shape == (5, 3, 24)
    assert torch.equal(y, torch.nn.functional.linear(x.float(), w.float()))


@pytest.mark.gpu
def test_linear_fp32_tensor_cores_match_the_upcast_gemm_gpu() -> None:
    """Router (E=256) and compressor (2 c d' = 2048) shapes of V4-Flash at 1 and 1024 tokens:
    within 1e-5 of the sum of |products| (fp32 accumulation; the CPU upcast GEMM: 3e-8), and
    the top-6 experts unchanged."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in (1, 1024):
        for n in (256, 2048):
            x = torch.randn(rows, 4096, device="cuda", generator=g).bfloat16()
            w = (torch.randn(n, 4096, device="cuda", generator=g) * 0.02).bfloat16()
            fast = linear_fp32(x, w)
            exact = torch.nn.functional.linear(x.double(), w.double())
            scale = torch.nn.functional.linear(x.double().abs(), w.double().abs())
            err = ((fast.double() - exact).abs() / scale).max().item()
            assert err < 1e-5, (rows, n, err)  # bf16 rounding: 4e-3
            if n == 256:
                upcast = torch.nn.functional.linear(x.float(), w.float())
                same = fast.topk(6).indices.sort().values == upcast.topk(6).indices.sort().values
                assert same.all(1).float().mean().item() > 0.99
