"""The model with its hot ops on the Triton kernels equals the model on the references."""

from __future__ import annotations

import torch

from dsv4.config.model import tiny_config
from dsv4.model.hot_ops import REFERENCE_OPS, HotOps
from dsv4.model.tiny import random_model
from dsv4.runner.kernel_bridge import BRIDGES, hot_ops, kernel_choices
from kernels.backend import KernelBackendConfig
from tests.kernels.conftest import DEVICE


def test_hot_ops_follow_the_kernel_config() -> None:
    """ "ref" keeps every reference; "triton" bridges exactly the five adapted ops; a per-op
    override moves one op alone."""
    assert hot_ops(KernelBackendConfig("ref"), DEVICE) == REFERENCE_OPS
    assert set(kernel_choices(KernelBackendConfig("ref"), DEVICE).values()) == {"ref"}
    chosen = kernel_choices(KernelBackendConfig("triton"), DEVICE)
    assert set(chosen) == {"route", "hc_pre", "hc_post", "fp8_linear", "fp8_grouped_linear"}
    assert set(chosen.values()) == {"triton"}
    triton = hot_ops(KernelBackendConfig("triton"), DEVICE)
    for name in HotOps.names():
        bridged = BRIDGES[name][1] if name in BRIDGES else getattr(REFERENCE_OPS, name)
        assert getattr(triton, name) is bridged, name
    only_route = hot_ops(KernelBackendConfig("ref", {"route": "triton"}), DEVICE)
    assert only_route == HotOps(route=BRIDGES["route"][1])


def test_model_logits_match_with_triton_hot_ops() -> None:
    torch.set_num_threads(1)
    cfg = tiny_config().with_overrides(
        num_hidden_layers=2, compress_ratios=(0, 4), num_nextn_predict_layers=0
    )
    model = random_model(cfg, seed=5, device=DEVICE)
    ids = torch.randint(2, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    ids = ids.to(DEVICE)
    assert model.ops == REFERENCE_OPS
    reference = model(ids).logits
    triton = hot_ops(KernelBackendConfig("triton"), DEVICE)
    model.use_hot_ops(triton)
    holders = [m for m in model.modules() if hasattr(m, "ops")]
    assert holders and all(m.ops is triton for m in holders)
    fused = model(ids).logits
    # fp32 model: the kernels reorder fp32 sums only (mixing GEMV, Sinkhorn, routing).
    assert torch.allclose(fused, reference, atol=2e-4, rtol=1e-4), (fused - reference).abs().max()
    model.use_hot_ops(REFERENCE_OPS)
    assert torch.equal(model(ids).logits, reference)
