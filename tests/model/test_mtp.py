"""The MTP layer against docs/model.md#mtp on hand-built inputs (MTP is not in transformers).

The input composition X0 = e_proj(enorm(e)) + h_proj(hnorm(X_prev)) is written out here by
hand; the block is checked against transformers' own decoder layer (a sliding-window, scored
MoE layer, which is what the MTP block is), loaded from the MTP weights renamed to layer 0;
the output is head(norm(hc_head_mtp(X1))) with transformers' hc_head/norm/head.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from dsv4.config.model import tiny_config
from tests.model.conftest import hf_config, tiny_model

ATOL = 5e-5
MTP_OWN = ("e_proj.", "h_proj.", "enorm.", "hnorm.", "norm.", "hc_head_")


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=4)


def _hf_from_mtp(model, path):
    """A 1-layer transformers model whose layer 0, hc_head and norm are the MTP's."""
    from transformers import DeepseekV4ForCausalLM

    state = model.state_dict()
    tensors = {"embed.weight": state["embed.weight"], "head.weight": state["head.weight"]}
    for name, value in state.items():
        if not name.startswith("mtp.0."):
            continue
        rest = name[len("mtp.0.") :]
        if rest.startswith(("norm.", "hc_head_")):
            tensors[rest] = value
        elif not rest.startswith(MTP_OWN):
            tensors[f"layers.0.{rest}"] = value
    cfg1 = tiny_config().with_overrides(
        num_hidden_layers=1, compress_ratios=(0,), num_hash_layers=0, num_nextn_predict_layers=0
    )
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(hf_config(cfg1).to_dict()))
    hf, info = DeepseekV4ForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return hf.eval()


def _rms(x, w, eps=1e-6):
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) * w


@torch.no_grad()
def test_mtp_matches_equations_and_transformers_block(model, tmp_path):
    cfg = model.cfg
    s, m, d = 70, cfg.hc_mult, cfg.hidden_size  # 70 > window 32
    gen = torch.Generator().manual_seed(0)
    x_prev = torch.randn(1, s, m, d, generator=gen)
    next_ids = torch.randint(0, cfg.vocab_size, (1, s), generator=gen)
    p = dict(model.named_parameters())
    e = p["embed.weight"][next_ids]  # [1, S, D]
    x0 = (_rms(e, p["mtp.0.enorm.weight"]) @ p["mtp.0.e_proj.weight"].T).unsqueeze(-2)
    x0 = x0 + _rms(x_prev, p["mtp.0.hnorm.weight"]) @ p["mtp.0.h_proj.weight"].T  # [1, S, M, D]

    hf = _hf_from_mtp(model, tmp_path)
    pos = torch.arange(s).unsqueeze(0)
    rope = {
        k: hf.model.rotary_emb(x0, position_ids=pos, layer_type=k) for k in ("main", "compress")
    }
    diff = pos[0].unsqueeze(-1) - pos[0]
    mask = torch.where((diff >= 0) & (diff < cfg.sliding_window), 0.0, float("-inf"))
    x1 = hf.model.layers[0](
        x0,
        position_embeddings=rope,
        position_ids=pos,
        attention_mask=mask[None, None],
        input_ids=next_ids,
    )
    expected = hf.lm_head(hf.model.norm(hf.model.hc_head(x1)))

    out = model.mtp_forward(x_prev, next_ids)
    torch.testing.assert_close(out.streams, x1, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.logits, expected, atol=ATOL, rtol=0)


@torch.no_grad()
def test_mtp_decode_with_cache_equals_full(model):
    cfg = model.cfg
    gen = torch.Generator().manual_seed(1)
    streams = torch.randn(45, cfg.hc_mult, cfg.hidden_size, generator=gen)
    next_ids = torch.randint(0, cfg.vocab_size, (45,), generator=gen)
    full = model.mtp_forward(streams, next_ids).logits
    state = model.new_state()
    first = model.mtp_forward(streams[:20], next_ids[:20], states=[state]).logits
    rest = [
        model.mtp_forward(streams[i : i + 1], next_ids[i : i + 1], states=[state]).logits
        for i in range(20, 45)
    ]
    torch.testing.assert_close(torch.cat([first, *rest]), full, atol=2e-5, rtol=0)
    assert state.mtp_num_tokens == 45 and state.num_tokens == 0


def test_mtp_block_is_scored_window_only(model):
    cfg = model.cfg
    block = model.mtp[0]
    assert block.layer_id == cfg.num_hidden_layers >= cfg.num_hash_layers
    assert block.ffn.gate.bias is not None and not hasattr(block.ffn.gate, "tid2eid")
    assert block.attn.ratio == cfg.mtp_compress_ratio == 0 and block.attn.compressor is None
    names = {n for n, _ in model.named_parameters() if n.startswith("mtp.")}
    assert not any("embed" in n or n.startswith("mtp.0.head") for n in names)
