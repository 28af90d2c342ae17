"""MoE routing and experts (docs/model.md#moe)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4.config.model import tiny_config
from dsv4.model.moe import MoE
from dsv4.ops.moe import route
from tests.model.conftest import tiny_model


def test_hash_routing_uses_tid2eid_only_on_hash_layers():
    model = tiny_model(seed=5)
    cfg = model.cfg
    assert cfg.num_hash_layers == 1
    for i, layer in enumerate(model.layers):
        gate = layer.ffn.gate
        assert gate.is_hash == (i < cfg.num_hash_layers)
        assert hasattr(gate, "tid2eid") == gate.is_hash
        assert (gate.bias is None) == gate.is_hash
    keys = model.state_dict().keys()
    assert "layers.0.ffn.gate.tid2eid" in keys and "layers.0.ffn.gate.bias" not in keys
    assert "layers.1.ffn.gate.bias" in keys and "layers.1.ffn.gate.tid2eid" not in keys

    gate = model.layers[0].ffn.gate
    u = torch.randn(6, cfg.hidden_size)
    ids = torch.tensor([3, 3, 7, 100, 1023, 0])
    weights, experts = gate(u, ids)
    assert torch.equal(experts, gate.tid2eid[ids])  # selection is the table, whatever u is
    scores = F.softplus(u @ gate.weight.T).sqrt().gather(-1, experts)
    torch.testing.assert_close(weights, scores / scores.sum(-1, keepdim=True) * 1.5)


def test_scored_routing_bias_selects_but_does_not_weight():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    bias = torch.tensor([10.0, 10.0, 0.0, 0.0])
    weights, ids = route(logits, bias, torch.tensor([0]), None, 2, 2.5)
    assert sorted(ids[0].tolist()) == [0, 1]  # the bias picks experts 0, 1
    s = F.softplus(logits[0, :2]).sqrt()
    torch.testing.assert_close(weights[0].sort().values, (s / s.sum() * 2.5).sort().values)


def test_expert_clamp_and_shared_switch():
    cfg = tiny_config()
    u = 30 * torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    clamped = MoE(cfg, 1)
    for p in clamped.parameters():
        torch.nn.init.normal_(p, std=0.1)
    free = MoE(cfg.with_overrides(clamp_shared_expert=False), 1)
    free.load_state_dict(clamped.state_dict())
    shared = clamped.shared_experts
    g, a = shared.w1(u), shared.w3(u)
    want = shared.w2(F.silu(g.clamp(max=10)) * a.clamp(-10, 10))
    torch.testing.assert_close(shared(u), want)
    assert free.shared_experts.limit is None and clamped.experts[0].limit == 10
    ids = torch.zeros(5, dtype=torch.long)
    assert not torch.allclose(clamped(u, ids), free(u, ids))  # |activations| > 10 here
