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
