"""The model with its hot ops on the Triton kernels equals the model on the references."""

from __future__ import annotations

import torch

from dsv4.model.config import tiny_config
from dsv4.model.kernel_bridge import install_kernels
from dsv4.model.layers import kernel_backend
from dsv4.model.tiny import random_model
from kernels.backend import KernelBackendConfig
from tests.kernels.conftest import DEVICE


def test_model_logits_match_with_triton_hot_ops() -> None:
    torch.set_num_threads(1)
    cfg = tiny_config().with_overrides(
        num_hidden_layers=2, compress_ratios=(0, 4), num_nextn_predict_layers=0
    )
    model = random_model(cfg, seed=5, device=DEVICE)
    ids = torch.randint(2, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    ids = ids.to(DEVICE)
    try:
        assert set(install_kernels(KernelBackendConfig("ref"), DEVICE).values()) == {"ref"}
        assert kernel_backend() == "torch"
        reference = model(ids).logits
        chosen = install_kernels(KernelBackendConfig("triton"), DEVICE)
        assert set(chosen) == {"route", "hc_pre", "hc_post", "fp8_linear", "fp8_grouped_linear"}
        assert set(chosen.values()) == {"triton"}
        fused = model(ids).logits
    finally:
        install_kernels(KernelBackendConfig("ref"), DEVICE)
    # fp32 model: the kernels reorder fp32 sums only (mixing GEMV, Sinkhorn, routing).
    assert torch.allclose(fused, reference, atol=2e-4, rtol=1e-4), (fused - reference).abs().max()
