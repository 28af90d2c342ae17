"""`choose_layout`: P and D sharing one card (or on cards of their own, `--gpus`), or one
colocated worker, decided from the plan each worker's start-up computes (`dsv4.worker.fit`).
Cards are sized from that plan's own numbers, so each case sits on the side of the line it
names."""

from __future__ import annotations

import pytest

from dsv4.commands.cluster import ClusterSpec
from dsv4.commands.layout import (
    NO_CARD,
    LayoutChoice,
    choose_layout,
    laid_out,
    plan_layout,
    spread_hint,
)
from dsv4.config import ServeConfig, load_config
from dsv4.config.model import ModelConfig, tiny_config
from dsv4.config.resolve import resolve_auto
from dsv4.errors import UsageError
from dsv4.plan import PlanDoesNotFit, shape_config
from dsv4.worker.fit import GIB, startup_plan

TINY = tiny_config()
CPU = {"model.device": "cpu", "model.max_model_len": 512, "scheduler.max_num_batched_tokens": 2048}
# V4-Flash on an H200 as the docs run it: FP8 linears and MXFP4 experts as stored
FLASH = {"model.device": "cuda", "model.max_model_len": 65536,
         "features.linear_weights": "checkpoint", "features.expert_weights": "checkpoint"}  # fmt: skip
H200 = int(139.8 * GIB)


def config(settings: dict[str, object]) -> ServeConfig:
    on_cuda = settings["model.device"] == "cuda"
    return resolve_auto(load_config(settings), has_cuda=on_cuda, hostname="h", pid=0)


def needed(cfg: ServeConfig, model: ModelConfig = TINY) -> int:
    """One worker's device bytes as its start-up plans them."""
    return startup_plan(cfg, model, 1 << 40).needed_bytes


def choose(requested: str, cfg: ServeConfig, card: int, model: ModelConfig = TINY, **counts):
    return choose_layout(requested, prefill=cfg, decode=cfg, model=model, card_bytes=card,
                         **counts)  # fmt: skip


def test_fits_twice_is_disaggregated_with_the_fraction_split() -> None:
    cfg = config(CPU)
    card = int(3 * needed(cfg) / 0.9)  # each of two gets 1.5x what it needs
    for requested in ("auto", "disaggregated"):
        choice = choose(requested, cfg, card)
        assert (choice.layout, choice.memory_fraction) == ("disaggregated", 0.45)
        assert choice.line.startswith("layout: disaggregated — 1 prefill + 1 decode worker share")
    three = choose("auto", cfg, 2 * card, num_prefill=2)  # 3 workers: 0.9 / 3 each
    assert (three.layout, three.memory_fraction) == ("disaggregated", 0.3)


def test_too_big_for_two_goes_colocated_and_says_why() -> None:
    cfg = config(CPU)
    card = int(1.5 * needed(cfg) / 0.9)  # one at 0.9: 1.5x; two at 0.45: 0.75x each
    choice = choose("auto", cfg, card)
    assert (choice.layout, choice.memory_fraction) == ("colocated", 0.9)
    assert choice.line.startswith("layout: colocated — 2 copies of the weights (2 x ")
    assert "one worker at --memory-fraction 0.9" in choice.line
    assert "\n" not in choice.line
    with pytest.raises(PlanDoesNotFit, match=r"^--layout disaggregated: 1 prefill \+ 1 decode"):
        choose("disaggregated", cfg, card)
    colocated = choose("colocated", cfg, card)
    assert (colocated.layout, colocated.memory_fraction) == ("colocated", 0.9)
    assert colocated.reason.startswith("as asked: one worker")


def test_too_big_for_one_is_refused_in_one_line() -> None:
    cfg = config(CPU)
    card = int(0.5 * needed(cfg) / 0.9)
    for requested, start in (("auto", "--layout auto: neither 2 workers"),
                             ("colocated", "--layout colocated: does not fit"),
                             ("disaggregated", "--layout disaggregated: ")):  # fmt: skip
        with pytest.raises(PlanDoesNotFit) as refused:
            choose(requested, cfg, card)
        assert refused.value.message.startswith(start) and "\n" not in refused.value.message


def test_no_card_plans_nothing_and_keeps_the_default() -> None:
    cfg = config(CPU)
    assert choose("auto", cfg, 0) == LayoutChoice("disaggregated", 0.0, NO_CARD)
    assert choose("disaggregated", cfg, 0).memory_fraction == 0.0
    assert choose("colocated", cfg, 0) == LayoutChoice("colocated", 0.0, NO_CARD)


def test_an_unknown_layout_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="--layout sideways"):
        choose("sideways", config(CPU), 1 << 40)


def test_too_many_workers_for_the_fraction_are_refused() -> None:
    with pytest.raises(PlanDoesNotFit, match=r"below 0\.01"):
        choose("disaggregated", config(CPU), 1 << 40, num_prefill=60, num_decode=60)


def test_flash_on_one_h200_auto_is_colocated_with_offload() -> None:
    """Two copies of V4-Flash (145 GiB of weights each) never fit a 139.8 GiB card: auto runs
    one worker, offloading experts to the --host-memory-gib given; without a host budget even
    that worker does not fit and `dsv4 up` refuses."""
    flash = shape_config("flash")
    choice = choose("auto", config({**FLASH, "model.host_memory_gib": 48}), H200, flash)
    assert choice.layout == "colocated" and choice.memory_fraction == 0.9
    assert choice.line.startswith("layout: colocated — 2 copies of the weights (2 x 145.")
    assert (
        "do not fit 139.8 GiB x 0.9" in choice.line and "experts per layer offloaded" in choice.line
    )
    with pytest.raises(PlanDoesNotFit, match=r"^--layout auto: neither"):
        choose("auto", config(FLASH), H200, flash)
    # the default weight formats (auto) resolve to those the checkpoint stores: the same choice
    default = {k: v for k, v in FLASH.items() if not k.endswith("_weights")}
    auto = choose("auto", config({**default, "model.host_memory_gib": 48}), H200, flash)
    assert auto == choice


def test_explicit_disaggregated_fits_only_where_offload_makes_it_fit() -> None:
    """As the worker's own plan allows: each share offloads what it cannot hold, if the host
    budget holds it; auto never picks that (it wants P and D without offload)."""
    flash = shape_config("flash")
    with pytest.raises(PlanDoesNotFit, match=r"pinned host memory.*--host-memory-gib gives 48"):
        choose("disaggregated", config({**FLASH, "model.host_memory_gib": 48}), H200, flash)
    big_host = config({**FLASH, "model.host_memory_gib": 256})
    choice = choose("disaggregated", big_host, H200, flash)
    assert (choice.layout, choice.memory_fraction) == ("disaggregated", 0.45)
    assert "experts per layer offloaded" in choice.reason
    assert choose("auto", big_host, H200, flash).layout == "colocated"


def test_laid_out_spec() -> None:
    spec = ClusterSpec(model_dir="m", num_prefill=2, num_decode=3, decode_args=("--x", "1"))
    both = laid_out(spec, LayoutChoice("disaggregated", 0.18, "r"))
    assert both.prefill_args == ("--memory-fraction", "0.18")
    assert both.decode_args == ("--x", "1", "--memory-fraction", "0.18")
    assert laid_out(spec, LayoutChoice("disaggregated", 0.0, NO_CARD)) == spec
    one = laid_out(spec, LayoutChoice("colocated", 0.9, "r"))
    assert (one.num_prefill, one.num_decode) == (0, 1)
    assert one.decode_args == ("--x", "1", "--role", "colocated")


def test_plan_layout_reads_the_workers_flags(tmp_path) -> None:
    """`dsv4 up`'s own path: the card and F come from the flags the workers get (a CPU card of
    --device-memory-gib G; a configured --memory-fraction 0.5 is split, 0.25 each)."""
    from dsv4.model.tiny import write_model_spec

    model_dir = str(write_model_spec(tmp_path, TINY))
    flags = ("--device", "cpu", "--device-memory-gib", "8", "--max-model-len", "512",
             "--max-num-batched-tokens", "2048")  # fmt: skip
    spec = ClusterSpec(model_dir=model_dir, service_args=(*flags, "--memory-fraction", "0.5"))
    laid, choice = plan_layout(spec, "auto")
    assert (choice.layout, choice.memory_fraction) == ("disaggregated", 0.25)
    assert laid.prefill_args == laid.decode_args == ("--memory-fraction", "0.25")
    laid, choice = plan_layout(ClusterSpec(model_dir=model_dir, service_args=flags[:2]), "auto")
    assert (laid, choice.reason) == (
        ClusterSpec(model_dir=model_dir, service_args=flags[:2]),
        NO_CARD,
    )


def test_gpus_plan_each_worker_on_a_whole_card() -> None:
    """`--gpus`: each worker at the full F of a card of its own, the plan line saying where; a
    card too small for one copy without offload goes colocated on the first card."""
    cfg = config(CPU)
    card = int(1.5 * needed(cfg) / 0.9)  # one copy fits a card at 0.9, two do not
    choice = choose("auto", cfg, card, cards=(0, 1))
    assert (choice.layout, choice.memory_fraction) == ("disaggregated", 0.9)
    assert choice.line.startswith("layout: disaggregated — prefill-0 on GPU 0, decode-0 on GPU 1, "
                                  "a card each at --memory-fraction 0.9: each needs ")  # fmt: skip
    assert choice.placement is not None and choice.placement.cards_of("decode-0") == (1,)
    small = int(0.9 * needed(cfg) / 0.9)
    with pytest.raises(PlanDoesNotFit, match=r"^--layout auto: neither a worker per card nor"):
        choose("auto", cfg, small, cards=(0, 1))
    flash = shape_config("flash")
    offload = choose("auto", config({**FLASH, "model.host_memory_gib": 48}), H200, flash,
                     cards=(2, 3))  # fmt: skip
    assert (offload.layout, offload.memory_fraction) == ("colocated", 0.9)
    assert offload.line.startswith("layout: colocated — one copy of the weights (145.")
    assert "without offload; one worker at --memory-fraction 0.9 on GPU 2, " in offload.line
    assert offload.placement is not None and offload.placement.cards_of("decode-0") == (2,)


def test_gpus_too_few_share_as_without_and_say_so() -> None:
    cfg = config(CPU)
    card = int(4.5 * needed(cfg) / 0.9)  # each of three at 0.3 gets 1.5x what it needs
    choice = choose("auto", cfg, card, cards=(1, 2), num_decode=2)
    assert (choice.layout, choice.memory_fraction) == ("disaggregated", 0.3)
    assert choice.reason.startswith("3 GPUs needed for cards of their own, --gpus gives 2; as "
                                    "without --gpus, 1 prefill + 2 decode workers share GPU 1 at "
                                    "--memory-fraction 0.3 each: each needs ")  # fmt: skip
    assert choice.placement is not None and choice.placement.shared
    colocated = choose("colocated", cfg, card, cards=(1, 2), num_decode=2)
    assert colocated.reason.startswith("as asked: one worker on GPU 1, ")


def test_laid_out_spec_carries_the_placement() -> None:
    choice = choose("auto", config(CPU), 1 << 40, cards=(0, 1))
    laid = laid_out(ClusterSpec(model_dir="m"), choice)
    assert laid.placement == choice.placement and laid.decode_args == ("--memory-fraction", "0.9")


def test_without_gpus_more_cards_than_used_are_named_in_the_plan_line() -> None:
    assert spread_hint(4, 1) == "; 4 GPUs visible: --gpus all gives each worker cards of its own"
    assert spread_hint(2, 2) == spread_hint(1, 1) == spread_hint(0, 1) == ""
