"""Checkpoint loading: formats, name spellings, and all-or-nothing failures."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsv4.config.model import tiny_config
from dsv4.errors import CheckpointError
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.model.inventory import model_tensors
from dsv4.model.tiny import write_checkpoint
from dsv4.model.weights import load_into, load_model, official_name, quantized_kind
from dsv4.ops.quant import fp8_block_dequantize, mxfp4_dequantize
from tests.model.conftest import tiny_model


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16")
    write_checkpoint(path, tiny_config(), seed=1, max_shard_bytes=1 << 20, with_tokenizer=False)
    return path


def _stored(path, name):
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(path / index[name]), "pt") as f:
        return f.get_tensor(name)


def test_quantized_checkpoint_is_dequantised_at_load(tmp_path):
    cfg = tiny_config().with_overrides(linear_dtype="fp8", expert_dtype="fp4")
    write_checkpoint(tmp_path, cfg, seed=2, max_shard_bytes=1 << 20, with_tokenizer=False)
    model, loaded_cfg = load_model(tmp_path)
    assert loaded_cfg.linear_dtype == "fp8" and loaded_cfg.expert_dtype == "fp4"
    state = model.state_dict()
    assert not any(k.endswith(".scale") for k in state)
    for name in (
        "layers.1.attn.wq_b.weight",
        "mtp.0.e_proj.weight",
        "layers.3.ffn.shared_experts.w2.weight",
    ):
        assert quantized_kind(name, cfg) == "fp8"
        stem = name[: -len(".weight")]
        want = fp8_block_dequantize(
            _stored(tmp_path, name), _stored(tmp_path, stem + ".scale"), 128, torch.float32
        )
        assert torch.equal(state[name], want)
    name = "layers.2.ffn.experts.5.w2.weight"
    assert quantized_kind(name, cfg) == "fp4"
    want = mxfp4_dequantize(
        _stored(tmp_path, name), _stored(tmp_path, "layers.2.ffn.experts.5.w2.scale"), torch.float32
    )
    assert torch.equal(state[name], want)
    assert quantized_kind("layers.1.attn.compressor.wkv.weight", cfg) is None
    assert torch.equal(
        state["layers.0.ffn.gate.tid2eid"], _stored(tmp_path, "layers.0.ffn.gate.tid2eid")
    )
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(40)).logits).all()


def test_bf16_sharded_checkpoint_and_dtype(bf16_ckpt):
    model, _ = load_model(bf16_ckpt, dtype=torch.bfloat16)
    state = model.state_dict()
    assert state["layers.1.attn.wq_a.weight"].dtype == torch.bfloat16
    assert state["layers.1.hc_attn_fn"].dtype == torch.float32  # docs/model.md#forward
    assert state["layers.1.attn.compressor.ape"].dtype == torch.float32
    assert torch.equal(state["embed.weight"], _stored(bf16_ckpt, "embed.weight"))


def test_transformers_hybrid_names():
    assert official_name("model.embed_tokens.weight") == "embed.weight"
    assert official_name("head.weight") == "head.weight"
    assert official_name("model.hc_head.hc_fn") == "hc_head_fn"
    assert official_name("model.norm.weight") == "norm.weight"
    assert official_name("model.layers.3.attn.norm.weight") == "layers.3.attn.kv_norm.weight"
    assert (
        official_name("model.layers.3.attn.compressor.norm.weight")
        == "layers.3.attn.compressor.norm.weight"
    )
    assert official_name("layers.3.attn.kv_norm.weight") == "layers.3.attn.kv_norm.weight"
    assert official_name("mtp.0.attn.norm.weight") == "mtp.0.attn.kv_norm.weight"


def _broken_copy(src, dst, edit):
    """Copy the checkpoint and apply `edit(tensors)` to the shard holding layers.1.attn.*."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    shard = dst / index["layers.1.attn.wq_b.weight"]
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard))
    index = {k: v for k, v in index.items() if k in tensors or v != shard.name}
    index.update({k: shard.name for k in tensors})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return dst


def _set(name, value):
    return lambda t: t.__setitem__(name, value)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.pop("layers.1.attn.wq_b.weight"),
            "missing tensor 'layers.1.attn.wq_b.weight'",
        ),
        (_set("layers.1.attn.bogus", torch.zeros(3)), "layers.1.attn.bogus"),
        (
            _set("layers.1.attn.wq_b.weight", torch.zeros(7, 5)),
            "'layers.1.attn.wq_b.weight' has shape (7, 5)",
        ),
        (
            _set("layers.1.attn.wq_b.weight", torch.zeros(1024, 128).to(torch.float8_e4m3fn)),
            "without a .scale",
        ),
    ],
    ids=["missing", "unexpected", "misshaped", "fp8-without-scale"],
)
def test_bad_checkpoint_raises_and_leaves_model_unchanged(bf16_ckpt, tmp_path, edit, message):
    path = _broken_copy(bf16_ckpt, tmp_path / "ckpt", edit)
    model = tiny_model(seed=9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_into(model, path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_truncated_file_raises_and_leaves_model_unchanged(bf16_ckpt, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(bf16_ckpt, path)
    shard = sorted(path.glob("*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    model = tiny_model(seed=9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=shard.name):
        load_into(model, path)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(CheckpointError, match=re.escape("no *.safetensors")):
        load_into(model, tmp_path / "empty_dir_that_does_not_exist")


def test_state_dict_names_are_the_official_inventory():
    cfg = tiny_config()
    with torch.device("meta"):
        model = DeepseekV4(cfg)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == {s.name: s.shape for s in model_tensors(cfg)}


@torch.no_grad()
def test_bf16_model_tracks_fp32(bf16_ckpt):
    ids = torch.arange(3, 200)
    fp32, _ = load_model(bf16_ckpt)
    bf16, _ = load_model(bf16_ckpt, dtype=torch.bfloat16)
    want, got = fp32(ids).logits, bf16(ids).logits
    assert got.dtype == torch.float32  # logits are returned in fp32
    assert (got - want).abs().mean() < 0.05 * want.abs().mean()
