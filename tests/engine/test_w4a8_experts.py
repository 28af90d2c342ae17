"""The W4A8 switch served (`features.moe_activations fp8`, issue 21): MXFP4 experts in the
halves128 layout with e4m3 activations above the GEMV's sizes (kernels/moe_w4a8.py). Its
prefill logits move by a bounded amount from the exact path's, decode-sized steps alone stay
exact, the expert pool serves it bit for bit as all-resident experts do, and the config refuses
it where no W4A8 kernel reads the experts."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from dsv4.config import load_config
from dsv4.errors import ConfigError
from dsv4.model.offload_load import ExpertOffload
from dsv4.model.tiny import random_model
from dsv4.runner.paged import PoolOptions, pool_experts
from dsv4.runner.paged.forward_state import PagedSwitches
from kernels.backend import KernelBackendConfig
from tests.engine.conftest import greedy_request, make_core
from tests.engine.test_expert_pool import _lockstep, _prompts
from tests.engine.test_halves_experts import FP4
from tests.engine.test_paged_forward import _lockstep_logits
from tests.leak import assert_no_leaks

EXACT = PagedSwitches(mxfp4_layout="halves128")
W4A8 = PagedSwitches(mxfp4_layout="halves128", moe_activations="fp8")


def test_prefill_logits_move_by_a_bounded_amount() -> None:
    """Two cores on the same tokens (64-token prefill chunks of 8 experts, top-2: 16 pairs an
    expert, above the GEMV's 3): the first sampled logits differ by the e4m3 rounding of x and
    h, a few percent, and every step's greedy choices stay mostly the same."""
    model = random_model(FP4, seed=2, expert_weights="checkpoint")
    cores = [make_core(m, budget=64, paged={"switches": s}, max_num_seqs=2)
             for m, s in ((model, EXACT), (copy.deepcopy(model), W4A8))]  # fmt: skip
    for core in cores:
        for rid, prompt in _prompts(FP4.vocab_size).items():
            core.add_request(greedy_request(rid, prompt, 6))
    steps = _lockstep_logits(*cores)
    for core in cores:
        assert_no_leaks(core)
    steps = [s for s in steps if s[0].numel()]  # steps that sample (a chunk ending a prompt)
    exact, w4a8 = steps[0]
    rel = ((w4a8 - exact).norm() / exact.norm()).item()
    assert 1e-4 < rel < 0.1, rel
    agree = [(a.argmax(-1) == b.argmax(-1)).float().mean().item() for a, b in steps]
    assert sum(agree) / len(agree) >= 0.75, agree


def test_pooled_w4a8_equals_all_resident_bit_for_bit() -> None:
    resident = random_model(FP4, seed=4, expert_weights="checkpoint")
    order = tuple((7, 2, 5, 0, 1, 3, 4, 6) for _ in range(FP4.num_hidden_layers))
    split = random_model(FP4, seed=4, expert_weights="checkpoint",
                         offload=ExpertOffload(5, 2, order))  # fmt: skip
    options = PoolOptions((5,), order, 1, 2, mxfp4_layout="halves128", moe_activations="fp8")
    pool = pool_experts(split, options, "cpu", KernelBackendConfig())
    assert {layer.activations for layer in pool.layers} == {"fp8"}
    steps, _ = _lockstep(resident, split, {"switches": W4A8})
    assert steps and all(torch.equal(a, b) for a, b in steps)


@pytest.mark.parametrize("values,names", [
    ({"features.moe_activations": "fp8", "features.mxfp4_layout": "stored"},
     "mxfp4_layout halves128"),
    ({"features.moe_activations": "fp8", "features.mxfp4_layout": "halves128",
      "features.expert_weights": "bf16"}, "expert_weights"),
])  # fmt: skip
def test_the_config_refuses_w4a8_without_its_layout(values, names) -> None:
    with pytest.raises(ConfigError, match="moe_activations") as err:
        load_config(values, None, {})
    assert names in str(err.value)
    config = load_config({"features.moe_activations": "fp8"}, None, {})  # halves128: the default
    assert config.features.moe_activations == "fp8" and config.features.mxfp4_layout == "halves128"


def test_experts_that_cannot_take_the_layout_run_exact_and_say_so(caplog) -> None:
    """The tiny default's experts (I 64) stay stored: the switch cannot apply, and the worker's
    log says why rather than serving the exact path silently under an fp8 setting."""
    small = random_model(FP4.with_overrides(moe_intermediate_size=64), seed=1,
                         expert_weights="checkpoint")  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="dsv4.runner.paged.forward"):
        make_core(small, budget=64, paged={"switches": W4A8})
    assert any("W4A8 does not apply" in r.getMessage() for r in caplog.records)
