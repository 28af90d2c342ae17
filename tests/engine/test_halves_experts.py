"""MXFP4 experts served in the re-packed "mxfp4_halves128" layout (`features.mxfp4_layout
halves128`, issue 21; the worker's default, `PagedSwitches`' baseline stays stored): the paged
forward re-packs the loaded experts once, in place, and its logits equal
those of the same checkpoint dequantised at load and of the stored layout; the reference forward,
the expert pool (from the load-time offload split) and a later offload still work.

Shapes: the tiny model with moe_intermediate_size 128, so both w13's rows (hidden 256) and w2's
(128) are whole 128-column blocks; the tiny default (64) is served as stored.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.config.model import tiny_config
from dsv4.errors import ConfigError
from dsv4.model.moe import mxfp4_layout_
from dsv4.model.offload import offload_model
from dsv4.model.offload_load import ExpertOffload
from dsv4.model.tiny import random_model, write_checkpoint
from dsv4.model.weights import load_model
from dsv4.ops.quant import HALVES_MAX_SCALE_BYTE, halves_scales_fit, repack_halves
from dsv4.runner.paged import PoolOptions, pool_experts
from dsv4.runner.paged.forward_state import PagedSwitches
from dsv4.runner.paged.pool_storage import expert_rows_of
from kernels.backend import KernelBackendConfig
from tests.engine.conftest import make_core
from tests.engine.test_expert_pool import _lockstep
from tests.engine.test_paged_forward import run

FP4 = tiny_config().with_overrides(expert_dtype="fp4", moe_intermediate_size=128,
                                   num_nextn_predict_layers=0)  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp4_halves")
    write_checkpoint(path, FP4, seed=5, max_shard_bytes=1 << 20, with_tokenizer=False)
    return path


def _formats(model) -> set[str]:
    return {block.ffn.stacked_experts.format for block in model.layers}


def test_paged_forward_on_halves_equals_the_dequantised_load_and_the_stored_layout(checkpoint):
    dense = load_model(checkpoint)[0]
    native = load_model(checkpoint, expert_weights="checkpoint")[0]
    stored_bytes = native.layers[0].ffn.stacked_experts.w13.clone()
    want = run(make_core(dense, budget=64, paged={}), dense)
    assert _formats(native) == {"mxfp4"}
    halves = {"switches": PagedSwitches(mxfp4_layout="halves128")}
    assert run(make_core(native, budget=64, paged=halves), native) == want
    assert _formats(native) == {"mxfp4_halves128"}
    assert not torch.equal(native.layers[0].ffn.stacked_experts.w13, stored_bytes)
    with torch.no_grad():  # the reference forward reads the re-packed storage
        ids = torch.arange(2, 42)[None]
        assert torch.equal(native(ids).logits, dense(ids).logits)
    assert run(make_core(native, budget=64, paged={}), native) == want  # the default: stored
    assert _formats(native) == {"mxfp4"}
    assert torch.equal(native.layers[0].ffn.stacked_experts.w13, stored_bytes)  # undone exactly


def test_offload_after_the_paged_forward_packs_the_stored_bytes(checkpoint):
    dense = load_model(checkpoint)[0]
    native = load_model(checkpoint, expert_weights="checkpoint")[0]
    for block in native.layers:
        mxfp4_layout_(block.ffn, "halves128")
    assert _formats(native) == {"mxfp4_halves128"}
    offload_model(native, num_offloaded=5, cache_slots=2, fmt="mxfp4")
    with torch.no_grad():
        ids = torch.arange(2, 30)[None]
        assert torch.equal(native(ids).logits, dense(ids).logits)


def test_pooled_halves_from_the_offload_split_equal_all_resident() -> None:
    """The load-time split's rows (as stored, on the device and in host memory) are re-packed
    as the pool reads them: the pool serves halves128 and equals the all-resident forward,
    which re-packs its stacked storage in place."""
    resident = random_model(FP4, seed=4, expert_weights="checkpoint")
    order = tuple((7, 2, 5, 0, 1, 3, 4, 6) for _ in range(FP4.num_hidden_layers))
    split = random_model(FP4, seed=4, expert_weights="checkpoint",
                         offload=ExpertOffload(5, 2, order))  # fmt: skip
    options = PoolOptions((5,), order, 1, 2, mxfp4_layout="halves128")
    store = split.layers[0].ffn.expert_store
    cold = sorted(store.host)
    stored = store.parts(cold[0])["w1"][0].clone()  # [I, H/2] as the checkpoint packs it
    blob = store.host[cold[0]]
    pool = pool_experts(split, options, "cpu", KernelBackendConfig())
    assert {layer.weights.format for layer in pool.layers} == {"mxfp4_halves128"}
    # the store's pinned blobs became the pool's host rows, re-packed in place (no host copy)
    host_w13 = pool.layers[0].host[0]
    assert host_w13.data_ptr() == blob.data_ptr()
    assert torch.equal(host_w13[0, : stored.shape[0]], repack_halves(stored, 128))
    steps, _ = _lockstep(resident, split, {"switches": PagedSwitches(mxfp4_layout="halves128")})
    assert _formats(resident) == {"mxfp4_halves128"}
    assert steps and all(torch.equal(a, b) for a, b in steps)


def test_layout_round_trip_and_what_stays_stored() -> None:
    model = random_model(FP4, seed=1, expert_weights="checkpoint")
    moe = model.layers[0].ffn
    before = moe.stacked_experts
    w13, w2 = before.w13.clone(), before.w2.clone()
    halves = mxfp4_layout_(moe, "halves128")
    assert halves.format == "mxfp4_halves128"
    assert halves.w13.data_ptr() == before.w13.data_ptr()  # in place: no second copy
    assert not torch.equal(halves.w13, w13)
    back = mxfp4_layout_(moe, "stored")
    assert back.format == "mxfp4" and torch.equal(back.w13, w13) and torch.equal(back.w2, w2)
    small = tiny_config().with_overrides(expert_dtype="fp4")  # I 64: not whole blocks
    kept = mxfp4_layout_(random_model(small, seed=1, expert_weights="checkpoint").layers[0].ffn,
                         "halves128")  # fmt: skip
    assert kept.format == "mxfp4"
    with pytest.raises(ConfigError, match="mxfp4_layout"):
        mxfp4_layout_(moe, "quarters")


def test_a_scale_byte_past_the_halves_bound_keeps_the_stored_layout(caplog) -> None:
    """The GPU kernel multiplies by 2^(s-1) in bf16, finite to s = 128: experts holding a larger
    scale byte (weights of 16 or more) stay stored, bit for bit, and the start-up log says so;
    128 itself still converts."""
    moe = random_model(FP4, seed=1, expert_weights="checkpoint").layers[0].ffn
    stacked = moe.stacked_experts
    w13 = stacked.w13.clone()
    scale = stacked.w2_scale.view(torch.uint8)
    scale[3, 5, 1] = HALVES_MAX_SCALE_BYTE + 1
    with caplog.at_level("WARNING"):
        kept = mxfp4_layout_(moe, "halves128")
    assert kept.format == "mxfp4" and torch.equal(kept.w13, w13)
    assert "keeps the stored layout" in caplog.text
    scale[3, 5, 1] = HALVES_MAX_SCALE_BYTE
    assert mxfp4_layout_(moe, "halves128").format == "mxfp4_halves128"
    assert halves_scales_fit(stacked.w13_scale, stacked.w2_scale, None)


def test_an_offload_store_past_the_halves_bound_pools_stored() -> None:
    """The pool's rows of an offload store take the same decision as a stacked storage: one
    cold expert's scale byte above the bound keeps the layer's rows (device and host) stored."""
    order = tuple((7, 2, 5, 0, 1, 3, 4, 6) for _ in range(FP4.num_hidden_layers))
    split = random_model(FP4, seed=4, expert_weights="checkpoint",
                         offload=ExpertOffload(5, 2, order))  # fmt: skip
    store = split.layers[0].ffn.expert_store
    cold = next(e for e in range(FP4.n_routed_experts) if e not in store.resident_row)
    store.parts(cold)["w3"][1].view(torch.uint8)[0, 0] = HALVES_MAX_SCALE_BYTE + 1
    rows = expert_rows_of(split.layers[0].ffn, "halves128")
    assert rows.format == "mxfp4"
    assert expert_rows_of(split.layers[1].ffn, "halves128").format == "mxfp4_halves128"
