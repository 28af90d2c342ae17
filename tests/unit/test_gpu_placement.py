"""`dsv4 up --gpus` (`dsv4.commands.placement`): what `--gpus` accepts, which cards each worker
gets (prefill first, T ranks on T cards, sharing when too few), and the CUDA_VISIBLE_DEVICES a
worker is given. The CLI's refusals run as a user runs them: the `dsv4` console script, one
line on stderr, exit 2."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4.commands.placement import (
    GpuRequest,
    Placement,
    WorkerCards,
    parse_gpus,
    place_workers,
    visible_devices,
)
from dsv4.errors import UsageError


@pytest.mark.parametrize(
    ("text", "request_"),
    [("all", GpuRequest("all")), ("4", GpuRequest("4", count=4)),
     ("0,2,3", GpuRequest("0,2,3", indices=(0, 2, 3))),
     (" 3, 1 ", GpuRequest("3, 1", indices=(3, 1)))],
)  # fmt: skip
def test_gpus_accepts_a_count_all_or_a_list(text: str, request_: GpuRequest) -> None:
    assert parse_gpus(text) == request_


@pytest.mark.parametrize(
    ("text", "says"),
    [("0", "no card asked"), ("x", "'x' is not a card count"), ("-1", "'-1' is not"),
     ("0,0", "card 0 is named twice"), ("1,x", "'x' is not a card index"),
     ("1,", "'' is not a card index"), ("1,-2", "'-2' is not a card index"), ("", "'' is not")],
)  # fmt: skip
def test_gpus_refuses_what_names_no_card(text: str, says: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        parse_gpus(text)


def test_the_cards_asked_must_be_visible() -> None:
    assert parse_gpus("all").cards(4) == (0, 1, 2, 3)
    assert parse_gpus("2").cards(4) == (0, 1)
    assert parse_gpus("3,1").cards(4) == (3, 1)
    for text, visible, says in (("5", 4, r"--gpus 5: 5 cards asked, 4 visible"),
                                ("0,4", 4, r"--gpus 0,4: no card 4 \(4 visible: 0\.\.3\)"),
                                ("all", 0, "--gpus all: no CUDA card visible"),
                                ("1", 0, "--gpus 1: no CUDA card visible")):  # fmt: skip
        with pytest.raises(UsageError, match=says):
            parse_gpus(text).cards(visible)


def test_each_worker_gets_cards_of_its_own_prefill_first() -> None:
    one_each = place_workers((0, 1), [("prefill-0", 1), ("decode-0", 1)])
    assert one_each == Placement(
        (WorkerCards("prefill-0", 1, (0,)), WorkerCards("decode-0", 1, (1,))), (0, 1)
    )
    assert one_each.text == "prefill-0 on GPU 0, decode-0 on GPU 1"
    ranks = place_workers((0, 2, 3, 5, 6, 7), [("prefill-0", 2), ("prefill-1", 2),
                                                ("decode-0", 1)])  # fmt: skip
    assert [w.cards for w in ranks.workers] == [(0, 2), (3, 5), (6,)]
    assert not ranks.shared and ranks.needed == 5
    assert ranks.text == ("prefill-0 on GPUs 0,2, prefill-1 on GPUs 3,5, decode-0 on GPU 6 "
                          "(GPU 7 idle)")  # fmt: skip
    assert ranks.cards_of("prefill-1") == (3, 5) and ranks.cards_of("router") == ()


def test_too_few_cards_share_the_first_ones_as_without_gpus() -> None:
    placed = place_workers((4, 5), [("prefill-0", 1), ("decode-0", 2)])
    assert placed.shared and placed.needed == 3
    assert [w.cards for w in placed.workers] == [(4,), (4, 5)]
    assert placed.text == "3 GPUs needed for cards of their own, --gpus gives 2"


def test_a_worker_with_more_ranks_than_cards_is_refused() -> None:
    """Its ranks would share a card the plan counts as one rank's."""
    with pytest.raises(UsageError, match=r"decode-0 has 4 ranks, a card each, but --gpus gives "
                                         r"3 cards"):  # fmt: skip
        place_workers((0, 1, 2), [("prefill-0", 1), ("decode-0", 4)])


def test_visible_devices_keeps_the_launchers_numbering() -> None:
    assert visible_devices((1, 2), None) == "1,2"
    assert visible_devices((0, 2), "4,5,6,7") == "4,6"
    assert visible_devices((1,), "GPU-aa, GPU-bb") == "GPU-bb"


# --- the CLI, as a terminal runs it -------------------------------------------------------

# Every one fails on any host: no host has 64 cards, nor card 63.
BAD_GPUS = [
    ["--gpus", "x"], ["--gpus", "0"], ["--gpus", "0,0"], ["--gpus", "64"], ["--gpus", "0,63"],
    ["--gpus", "2", "--device", "cpu"],
]  # fmt: skip


def test_bad_gpus_is_one_line_and_exit_2(tmp_path: Path) -> None:
    from dsv4.model.tiny import tiny_config, write_model_spec

    model = str(write_model_spec(tmp_path / "spec", tiny_config()))
    dsv4 = Path(sys.executable).with_name("dsv4")  # the console script a user runs
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_")}  # no traceback
    runs = [
        (flags, subprocess.Popen([str(dsv4), "up", "--model", model, *flags], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for flags in BAD_GPUS
    ]  # fmt: skip
    for flags, process in runs:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 2 and out == "", (flags, out, err)
        assert len(err.splitlines()) == 1 and "Traceback" not in err, (flags, err)
        assert err.startswith("dsv4 up: error: ") and ("--gpus" in err or "--device" in err)
