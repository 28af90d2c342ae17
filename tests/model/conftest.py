"""Shared fixtures: a randomised transformers DeepSeek-V4 checkpoint (saved once per session)
and randomised tiny models of our own."""

from __future__ import annotations

import pytest
import torch

from dsv4.config.model import ModelConfig, tiny_config
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.model.tiny import random_model

# Keys of ModelConfig.to_hf_dict() that transformers' DeepseekV4Config does not know.
OUR_EXTRA_KEYS = ("clamp_shared_expert", "expert_dtype")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Run the model tests on one thread: their ops are tiny, and on 2 shared, busy cores
    2-thread OpenMP spin-waits made decode steps ~10x slower (60 ms vs 600 ms measured)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_model(cfg: ModelConfig | None = None, seed: int = 0) -> DeepseekV4:
    return random_model(cfg or tiny_config(), seed)


def randomize_hf(model: torch.nn.Module, seed: int = 0) -> None:
    """Deterministic non-trivial values for every transformers tensor, tid2eid included.

    The indexer's query heads come in pairs (h, -h) with equal `weights_proj` rows, so every
    indexer score is sum_k w_k * |q_k . k| and never an exact tie at 0: ReLU ties would be
    broken differently by transformers (`torch.topk`) and by us (lower index first).
    """
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    with torch.no_grad():
        for name, t in sorted(model.state_dict(keep_vars=True).items()):
            if name.endswith("tid2eid"):
                scores = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=gen)
                t.copy_(scores.argsort(dim=1)[:, : cfg.num_experts_per_tok])
            elif not t.is_floating_point():
                continue
            elif "norm" in name:
                t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=gen))
            elif name.endswith(("hc.fn", "hc_fn")):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.5 / t.shape[-1] ** 0.5)
            elif name.endswith(("hc.base", "hc_base", "sinks", "position_bias")):
                t.copy_(0.5 * torch.randn(t.shape, generator=gen))
            elif name.endswith(("hc.scale", "hc_scale")):
                t.copy_(1.0 + 0.25 * torch.rand(t.shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.3 * torch.randn(t.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                t.copy_(torch.randn(t.shape, generator=gen))
            else:  # linears and stacked experts: N(0, 1/fan_in)
                t.copy_(torch.randn(t.shape, generator=gen) / t.shape[-1] ** 0.5)
        for layer in model.model.layers:
            comp = layer.self_attn.compressor
            indexer = getattr(comp, "indexer", None)
            if indexer is None:
                continue
            q = indexer.q_b_proj.weight.view(indexer.num_heads, indexer.head_dim, -1)
            q[1::2] = -q[0::2]
            w = indexer.scorer.weights_proj.weight
            w[1::2] = w[0::2]


def hf_config(cfg: ModelConfig):
    from transformers import DeepseekV4Config

    raw = cfg.to_hf_dict()
    for key in OUR_EXTRA_KEYS:
        raw.pop(key, None)
    return DeepseekV4Config(**raw)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """(checkpoint dir, transformers model) for tiny_config(), saved once per session."""
    from transformers import DeepseekV4ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    hf = DeepseekV4ForCausalLM(hf_config(tiny_config())).eval()
    randomize_hf(hf, seed=0)
    path = tmp_path_factory.mktemp("hf_tiny")
    hf.save_pretrained(path)
    return path, hf
