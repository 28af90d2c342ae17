"""`features.expert_weights` / `linear_weights` "auto" (issues 21, 22): start-up planning resolves
them (`dsv4.worker.fit.resolve_weight_formats`) to the formats the checkpoint stores on a GPU
(faster end to end than bf16), to bf16 with no device plan or several tensor-parallel ranks."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from dsv4.config import load_config, resolve_auto
from dsv4.config.model import tiny_config
from dsv4.plan import FITS, FITS_WITH_OFFLOAD, FITS_WITH_OFFLOAD_OVER_SLO, shape_config
from dsv4.worker.fit import GIB, device_plan, resolve_weight_formats, startup_config

FLASH = shape_config("flash")


def _config(values: dict, model=FLASH):
    return resolve_auto(load_config(values, None, {}), has_cuda=True, hostname="h", pid=1,
                        model=model)  # fmt: skip


@pytest.fixture
def fit_logs(caplog, monkeypatch):
    """caplog for dsv4.worker.fit whatever earlier tests did to logging: a library's
    dictConfig(disable_existing_loggers=True) disables loggers that exist, and a handler setup
    may stop propagation on the way to the root's capture handler, logging.disable mutes all."""
    monkeypatch.setattr(logging.root.manager, "disable", logging.NOTSET)  # logging.disable(...)
    for name in ("dsv4.worker.fit", "dsv4.worker", "dsv4"):
        log = logging.getLogger(name)
        monkeypatch.setattr(log, "disabled", False)
        monkeypatch.setattr(log, "propagate", True)
    return caplog


def _formats(config) -> tuple[str, str]:
    return config.features.expert_weights, config.features.linear_weights


def test_flash_on_one_h200_takes_the_checkpoints_formats_and_fits_with_offload(fit_logs) -> None:
    caplog = fit_logs
    config = _config({"model.host_memory_gib": 128})
    assert _formats(config) == ("auto", "auto")
    with caplog.at_level(logging.INFO, logger="dsv4.worker.fit"):
        resolved, plan = device_plan(config, FLASH, 141 * GIB)
    assert _formats(resolved) == ("checkpoint", "checkpoint")
    assert plan.verdict in (FITS_WITH_OFFLOAD, FITS_WITH_OFFLOAD_OVER_SLO)
    lines = [r.getMessage() for r in caplog.records if "weights auto" in r.getMessage()]
    assert lines == ["weights auto: checkpoint formats (MXFP4 experts, FP8 linears): faster end "
                     "to end than bf16 (docs/BENCHMARKS.md)"]  # fmt: skip


def test_flash_on_a_card_big_enough_for_bf16_still_takes_the_checkpoints_formats() -> None:
    resolved, plan = device_plan(_config({}), FLASH, 1024 * GIB)
    assert _formats(resolved) == ("checkpoint", "checkpoint") and plan.verdict == FITS

    # 8 x 141 GiB (`dsv4 plan --gpus 8`'s request: TP 8): tensor parallelism shards bf16 only
    def to_eight(req):
        return replace(req, num_gpus=8, tp=8, ep=8, gpus_per_node=8)

    assert _formats(startup_config(_config({}), FLASH, 141 * GIB, to_eight)) == ("bf16", "bf16")


def test_several_ranks_and_no_plan_and_bf16_checkpoints_resolve_to_bf16() -> None:
    ranks = _config({"model.tensor_parallel_size": 8})  # sharding holds bf16 weights only
    assert _formats(resolve_weight_formats(ranks, FLASH, 141 * GIB)) == ("bf16", "bf16")
    assert _formats(resolve_weight_formats(_config({}), FLASH, 0)) == ("bf16", "bf16")
    tiny = tiny_config()  # stores bf16: nothing else to resolve to, even on a budget too small
    for total in (GIB // 100, GIB):
        assert _formats(resolve_weight_formats(_config({}, tiny), tiny, total)) == ("bf16", "bf16")


@pytest.mark.parametrize("formats", [("bf16", "bf16"), ("checkpoint", "bf16"),
                                     ("bf16", "checkpoint"), ("checkpoint", "checkpoint")])  # fmt: skip
def test_explicit_formats_are_left_alone(formats) -> None:
    experts, linears = formats
    config = _config({"features.expert_weights": experts, "features.linear_weights": linears})
    assert resolve_weight_formats(config, FLASH, 141 * GIB) is config


def test_one_auto_setting_resolves_alone_and_fp8_activations_hold_linears_as_stored() -> None:
    mixed = _config({"features.linear_weights": "bf16"})
    assert _formats(resolve_weight_formats(mixed, FLASH, 141 * GIB)) == ("checkpoint", "bf16")
    fp8 = _config({"features.linear_activations": "fp8", "features.expert_weights": "bf16"})
    assert _formats(resolve_weight_formats(fp8, FLASH, 1024 * GIB)) == ("bf16", "checkpoint")
    # fp8 activations hold the linears as stored even where auto would take bf16 (no plan)
    assert _formats(resolve_weight_formats(_config(
        {"features.linear_activations": "fp8"}), FLASH, 0)) == ("bf16", "checkpoint")  # fmt: skip


def test_a_fuse_the_resolved_formats_forbid_is_turned_off(fit_logs) -> None:
    caplog = fit_logs
    config = _config({"features.fuse_shared_expert": True})
    with caplog.at_level(logging.WARNING, logger="dsv4.worker.fit"):
        resolved = resolve_weight_formats(config, FLASH, 141 * GIB)
    assert _formats(resolved) == ("checkpoint", "checkpoint")
    assert not resolved.features.fuse_shared_expert and "fuse_shared_expert off" in caplog.text
    none = resolve_weight_formats(config, FLASH, 0)  # no plan: bf16, the fuse stays
    assert _formats(none) == ("bf16", "bf16") and none.features.fuse_shared_expert
