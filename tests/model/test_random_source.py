"""`--model random:DIR`: DIR's config.json and tokenizer, weights drawn from model.seed, the same
in every process (what the H200 end-to-end run serves at Flash dimensions)."""

from __future__ import annotations

import torch

from dsv4.config import load_config
from dsv4.config.model import ModelConfig, tiny_config
from dsv4.model.tiny import random_model, write_model_spec
from dsv4.worker.build import load_weights, planned_model_config
from router_svc.text_model import load_text_model


def test_random_source_serves_the_config_with_seeded_weights(tmp_path) -> None:
    cfg = tiny_config().with_overrides(num_hidden_layers=2, compress_ratios=(0, 4))
    spec_dir = write_model_spec(tmp_path / "spec", cfg)
    assert sorted(p.name for p in spec_dir.iterdir()) == [
        "config.json", "tokenizer.json", "tokenizer_config.json"
    ]  # fmt: skip
    config = load_config({"model.path": f"random:{spec_dir}", "model.seed": 7,
                          "model.device": "cpu", "model.dtype": "fp32"}, None, {})  # fmt: skip
    assert config.model.is_random and config.model.model_dir == str(spec_dir)
    assert planned_model_config(config) == ModelConfig.from_file(spec_dir)
    model, loaded_cfg, codec = load_weights(config)
    expected = random_model(loaded_cfg, seed=7).state_dict()
    got = model.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in got)
    assert codec is not None and codec.decode(codec.encode("def f(x):")) == "def f(x):"
    assert load_text_model(config.model).codec is not None  # the router finds the tokenizer
