"""A worker refuses to start, before loading anything, when the plan says it cannot fit."""

from __future__ import annotations

import pytest

from dsv4.config import load_config
from dsv4.config.model import tiny_config
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


def test_warm_up_covers_every_size_class_and_specialisation() -> None:
    """Kernels compile once per next_power_of_2 class of tokens and entries and per "divisible
    by 16" specialisation of their integer arguments: the start-up requests visit each class
    with tokens and ratio-4 entries both divisible, both not, and mixed."""
    from dsv4.worker.options import warm_up_lengths

    lengths = warm_up_lengths(16384, 8704)
    assert lengths[-1] == 8696 and max(lengths) == 8696 and len(set(lengths)) == len(lengths)
    for p in range(7, 14):  # every class up to the budget, each with all four combinations
        in_class = [n for n in lengths if (1 << (p - 1)) < n <= (1 << p)]
        combos = {(n % 16 == 0, (n // 4) % 16 == 0) for n in in_class}
        assert combos == {(True, True), (False, False), (True, False), (False, True)}, p
    assert warm_up_lengths(2048, 131072)[-2:] == (2048, 131064)
    assert warm_up_lengths(8, 100) == (8, 92) and warm_up_lengths(64, 10) == (2,)
    # scheduler.warm_up=powers: one prompt per class, plus the largest and the longest
    assert warm_up_lengths(1000, 1280, powers_only=True) == (16, 32, 64, 128, 256, 512, 1000, 1272)
