"""A worker refuses to start, before loading anything, when the plan says it cannot fit."""

from __future__ import annotations

import pytest

from dsv4.config import load_config
from dsv4.model.config import tiny_config
from dsv4.plan import PlanDoesNotFit, full_flash_config
from dsv4.worker.fit import GIB, startup_plan


def test_full_flash_on_one_80gb_card_refuses_with_the_shortfall() -> None:
    config = load_config({"model.max_model_len": 65536}, None, {})
    with pytest.raises(PlanDoesNotFit) as failure:
        startup_plan(config, full_flash_config(), 80 * GIB)
    message = failure.value.message
    assert "does not fit" in message and "GiB" in message


def test_tiny_model_fits_a_small_card() -> None:
    config = load_config({"model.max_model_len": 4096}, None, {})
    plan = startup_plan(config, tiny_config(), 8 * GIB)
    assert plan.fits


def test_warm_up_covers_every_power_of_two_size_class() -> None:
    """Kernels compile once per next_power_of_2 class of tokens and entries: the start-up
    requests visit each class up to one step's budget, then a max-length prompt."""
    from dsv4.worker.build import warm_up_lengths

    assert warm_up_lengths(16384, 8704) == (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                            8696)  # fmt: skip
    assert warm_up_lengths(2048, 131072)[-3:] == (1024, 2048, 131064)
    assert warm_up_lengths(8, 100) == (8, 92) and warm_up_lengths(64, 10) == (2,)
