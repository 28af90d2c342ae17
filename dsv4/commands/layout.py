"""`dsv4 up --layout` and `--gpus`: prefill and decode workers side by side, or one colocated
worker doing both; on one card they all share, or on cards of their own.

Without `--gpus`, `dsv4 up` starts every worker on the same device (cuda:0, or the `--device
cuda:N` given; a worker of T ranks on cuda:0..T-1, so each of those cards holds one rank of every
worker). With `--gpus` (`dsv4.commands.placement`) each worker gets whole cards of its own,
prefill workers first, as its CUDA_VISIBLE_DEVICES; with too few cards for that, they share the
selection's first cards as without it. Each worker holds its own copy of the weights.
`choose_layout` decides from the plan each worker's start-up computes
(`dsv4.worker.fit.device_plan`: same arithmetic, same refusals):

- disaggregated: on cards of their own, each worker at the configured `cache.memory_fraction` F;
  sharing, the N workers each at `--memory-fraction F/N`. Refused unless each fits (offloading
  experts where `--host-memory-gib` allows it, as the worker's own plan would).
- colocated: one worker at F (on the first cards of `--gpus`); refused unless it fits (offload
  as configured).
- auto: disaggregated when every worker fits without offload, else colocated; the plan line
  says why, and where the workers run.

No card to plan (a CPU device without `--device-memory-gib`): nothing is checked and auto is
disaggregated, as `dsv4 up` always was. On CPU, `--device-memory-gib G` is one card of G GiB.
The card planned under `--gpus` is the smallest one given (`--device-memory-gib`, when set).
Without `--gpus` the workers stay on one card even where more are visible (spreading them
unasked could take cards other jobs use); the plan line then names how many are visible
(`spread_hint`).

Whatever the device, every rank process of every worker needs host memory (the Python runtime
and torch: `PROCESS_HOST_BYTES` at least), and on CPU each worker holds its weights there too:
a cluster whose processes cannot all fit the host's available memory is refused before any
starts (`check_host_memory`), naming --num-prefill / --num-decode.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from dsv4.commands.cluster import ClusterSpec
from dsv4.commands.placement import (
    GpuRequest,
    Placement,
    cuda_cards,
    gpu_names,
    place_workers,
)
from dsv4.commands.service_args import service_config
from dsv4.config import ServeConfig
from dsv4.config.model import ModelConfig
from dsv4.config.resolve import resolve_auto
from dsv4.errors import UsageError
from dsv4.plan import MemoryPlan, PlanDoesNotFit, plan_memory
from dsv4.worker.fit import (
    GIB,
    device_plan,
    planned_model_config,
    size_text,
    startup_config,
    startup_request,
)

LAYOUTS = ("auto", "disaggregated", "colocated")
DISAGGREGATED, COLOCATED = "disaggregated", "colocated"
MIN_FRACTION = 0.01  # cache.memory_fraction's own minimum
# An idle tiny-model CPU worker holds ~1 GiB resident, part of it shared libraries: a floor.
PROCESS_HOST_BYTES = 3 * GIB // 4
NO_CARD = "no card to plan (a CPU device: give --device-memory-gib G to plan G GiB as one card)"


@dataclass(frozen=True)
class LayoutChoice:
    layout: str  # disaggregated | colocated
    memory_fraction: float  # each worker's cache.memory_fraction; 0: as configured (no card)
    reason: str  # why, in one line
    placement: Placement | None = None  # each worker's cards under --gpus; None: as inherited

    @property
    def line(self) -> str:
        """The plan line `dsv4 up` prints at start."""
        return f"layout: {self.layout} — {self.reason}"


def choose_layout(
    requested: str,
    *,
    prefill: ServeConfig,
    decode: ServeConfig,
    model: ModelConfig,
    card_bytes: int,
    num_prefill: int = 1,
    num_decode: int = 1,
    cards: tuple[int, ...] = (),
) -> LayoutChoice:
    """The layout of `num_prefill` P + `num_decode` D workers (resolved configs, as their
    start-up sees them) on cards of `card_bytes` (0: none to plan): the `--gpus` selection
    `cards`, or one card they all share (none given). Pure arithmetic; raises `PlanDoesNotFit`
    (one line) for a layout that cannot fit."""
    if requested not in LAYOUTS:
        raise UsageError(f"--layout {requested}: give one of {', '.join(LAYOUTS)}")
    fraction = decode.cache.memory_fraction
    alone = place_workers(cards, [("decode-0", _ranks(decode))]) if cards else None
    where = f" on {gpu_names(alone.workers[0].cards)}" if alone else ""
    if requested == COLOCATED:
        if not card_bytes:
            return LayoutChoice(COLOCATED, 0.0, NO_CARD, alone)
        whole = _fit(decode, model, card_bytes, fraction, "--layout colocated")
        return LayoutChoice(COLOCATED, fraction, f"as asked: one worker{where}, {_usage(whole)}",
                            alone)  # fmt: skip
    names = [(f"prefill-{i}", _ranks(prefill)) for i in range(num_prefill)]
    names += [(f"decode-{i}", _ranks(decode)) for i in range(num_decode)]
    spread = place_workers(cards, names) if cards else None
    if not card_bytes:
        return LayoutChoice(DISAGGREGATED, 0.0, NO_CARD, spread)
    workers = num_prefill + num_decode
    per_card = 1 if spread and not spread.shared else workers
    share = float(f"{fraction / per_card:.6g}")  # what the workers' flag will say
    sharing = _placed_text(spread, num_prefill, num_decode, share)
    if share < MIN_FRACTION:
        raise PlanDoesNotFit(f"--layout {requested}: {sharing}, below {MIN_FRACTION:g}")
    pools = ((prefill, "prefill"), (decode, "decode"))
    if requested == DISAGGREGATED:
        plans = [_fit(cfg, model, card_bytes, share,
                      f"--layout disaggregated: {sharing}; the {role} worker's plan")
                 for cfg, role in pools]  # fmt: skip
        return LayoutChoice(DISAGGREGATED, share, _shared_reason(sharing, plans), spread)
    try:
        plans = [_fit(cfg, model, card_bytes, share, "", offload=False) for cfg, _ in pools]
        return LayoutChoice(DISAGGREGATED, share, _shared_reason(sharing, plans), spread)
    except PlanDoesNotFit:
        pass
    tried = "a worker per card" if per_card == 1 else f"{workers} workers sharing the card"
    prefix = (f"--layout auto: neither {tried} nor one colocated worker fits; the colocated "
              "worker's plan")  # fmt: skip
    whole = _fit(decode, model, card_bytes, fraction, prefix)
    alone_copy = startup_config(_at(decode, share, offload=False), model, card_bytes)
    copies = plan_memory(startup_request(alone_copy, model, card_bytes))
    reason = _colocated_reason(copies, whole, per_card, card_bytes, where)
    return LayoutChoice(COLOCATED, fraction, reason, alone)


def _ranks(config: ServeConfig) -> int:
    return config.model.tensor_parallel_size


def _placed_text(spread: Placement | None, num_prefill: int, num_decode: int, share: float) -> str:
    """Where the P and D workers run, at what fraction: a card each, or sharing."""
    if spread and not spread.shared:
        return f"{spread.text}, a card each at --memory-fraction {share:g}"
    counts = (f"{num_prefill} prefill + {num_decode} decode "
              f"worker{'s' * (num_prefill + num_decode > 2)}")  # fmt: skip
    if spread is None:
        return f"{counts} share the card at --memory-fraction {share:g} each"
    first = max(spread.workers, key=lambda w: w.ranks).cards
    return (f"{spread.text}; as without --gpus, {counts} share {gpu_names(first)} at "
            f"--memory-fraction {share:g} each")  # fmt: skip


def _at(config: ServeConfig, fraction: float, *, offload: bool = True) -> ServeConfig:
    """`config` at `fraction` of the card (and without expert offload unless `offload`)."""
    cache = dataclasses.replace(config.cache, memory_fraction=fraction)
    model = config.model if offload else dataclasses.replace(config.model, host_memory_gib=0.0)
    return dataclasses.replace(config, cache=cache, model=model)


def _fit(config: ServeConfig, model: ModelConfig, card_bytes: int, fraction: float, refusal: str,
         *, offload: bool = True) -> MemoryPlan:  # fmt: skip
    """The worker's own start-up plan at `fraction`; a refusal starts with `refusal`."""
    try:
        return device_plan(_at(config, fraction, offload=offload), model, card_bytes)[1]
    except PlanDoesNotFit as exc:
        raise PlanDoesNotFit(f"{refusal}: {exc.message}" if refusal else exc.message) from None


def _reserve(plan: MemoryPlan) -> int:
    """KV, step workspaces and graph pools: what a worker needs beside its weights."""
    return plan.kv.total_bytes + plan.buffer_bytes


def _offloaded(plan: MemoryPlan) -> str:
    k = plan.offloaded_per_layer
    return f", {k} of {plan.experts_per_layer} experts per layer offloaded" if k else ""


def _usage(plan: MemoryPlan) -> str:
    """Device bytes against usable ones; weights as held on the device (after any offload)."""
    device_weights = plan.needed_bytes - _reserve(plan)
    return (f"{size_text(plan.needed_bytes)} of {size_text(plan.usable_bytes)} usable (weights "
            f"{size_text(device_weights)} + KV/workspaces {size_text(_reserve(plan))})"
            f"{_offloaded(plan)}")  # fmt: skip


def _shared_reason(sharing: str, plans: list[MemoryPlan]) -> str:
    largest = max(plans, key=lambda p: p.needed_bytes)
    return f"{sharing}: each needs {_usage(largest)}"


def _colocated_reason(copies: MemoryPlan, whole: MemoryPlan, per_card: int, card: int,
                      where: str) -> str:  # fmt: skip
    """`copies`: one worker's plan at its share, without offload (`per_card` of them on a
    card); `whole`: the colocated one, placed `where`."""
    fraction = whole.request.memory_fraction
    if per_card == 1:
        held = (f"one copy of the weights ({size_text(copies.weight_bytes)}) + KV/workspaces "
                f"({size_text(_reserve(copies))}) does not fit {size_text(card)} x {fraction:g} "
                f"({size_text(copies.usable_bytes)} usable) without offload")  # fmt: skip
    else:
        k = per_card
        held = (f"{k} copies of the weights ({k} x {size_text(copies.weight_bytes)}) + "
                f"KV/workspaces ({k} x {size_text(_reserve(copies))}) do not fit "
                f"{size_text(card)} x {fraction:g} ({k} x {size_text(copies.usable_bytes)} "
                "usable)")  # fmt: skip
    return f"{held}; one worker at --memory-fraction {fraction:g}{where}{_offloaded(whole)}"


def plan_layout(
    spec: ClusterSpec, requested: str, gpus: GpuRequest | None = None
) -> tuple[ClusterSpec, LayoutChoice]:
    """`spec` laid out as `requested` on the cards its workers will use (`gpus`: the `--gpus`
    asked; None: the one card they share), and the choice."""
    redis = ("--redis", spec.redis_url) if spec.redis_url else ()  # its URL checked too
    configs = {role: service_config(("--model", spec.model_dir, *redis, *spec.service_args,
                                     *args), os.environ)
               for role, args in (("prefill", spec.prefill_args), ("decode", spec.decode_args))}  # fmt: skip
    device = configs["decode"].model.device
    if gpus is not None:
        _check_gpus_device(gpus, device)
    visible = () if device == "cpu" else cuda_cards()
    cards = gpus.cards(len(visible)) if gpus is not None else ()
    index = int(device.partition(":")[2] or 0)
    if cards:
        total = min(visible[c] for c in cards)  # plan on the smallest card given
    else:
        total = visible[index] if index < len(visible) else 0
    model = planned_model_config(configs["decode"])  # both roles serve spec.model_dir
    resolved = {role: resolve_auto(c, has_cuda=total > 0, hostname="up", pid=0, model=model)
                for role, c in configs.items()}  # fmt: skip
    decode = resolved["decode"]
    card = int(decode.model.device_memory_gib * GIB)
    if not card and decode.model.device.startswith("cuda"):
        card = total
    choice = choose_layout(
        requested, prefill=resolved["prefill"], decode=decode,
        model=model, card_bytes=card,
        num_prefill=spec.num_prefill, num_decode=spec.num_decode, cards=cards,
    )  # fmt: skip
    if gpus is None and requested != COLOCATED:
        hint = spread_hint(len(visible), max(_ranks(c) for c in resolved.values()))
        choice = dataclasses.replace(choice, reason=choice.reason + hint)
    placed = laid_out(spec, choice)
    check_host_memory(spec, placed, resolved, host_available_bytes())
    return placed, choice


def check_host_memory(spec: ClusterSpec, placed: ClusterSpec, resolved: dict[str, ServeConfig],
                      available: int) -> None:  # fmt: skip
    """`UsageError` naming --num-prefill / --num-decode (as `spec` has them) when the rank
    processes of `placed`'s workers need more than the `available` host bytes (0: unknown,
    nothing checked): `PROCESS_HOST_BYTES` each, and on CPU each worker's weights."""
    if not available:
        return
    pools = (("prefill", placed.num_prefill), ("decode", placed.num_decode))
    processes = sum(count * _ranks(resolved[role]) for role, count in pools)
    on_cpu = resolved["decode"].model.device == "cpu"
    weights = checkpoint_bytes(spec.model_dir) if on_cpu else 0
    workers = placed.num_prefill + placed.num_decode
    need = processes * PROCESS_HOST_BYTES + workers * weights
    if need <= available:
        return
    each = f"{size_text(PROCESS_HOST_BYTES)} a process" + (
        f" + {size_text(weights)} of weights a worker" if weights else "")  # fmt: skip
    raise UsageError(
        f"--num-prefill {spec.num_prefill} --num-decode {spec.num_decode}: {processes} worker "
        f"process{'es' * (processes != 1)} need at least {size_text(need)} of host memory "
        f"({each}), {size_text(available)} available; give fewer workers"
    )


def checkpoint_bytes(model_dir: str) -> int:
    """The checkpoint's weight files on disk (0 for `random:DIR`, whose weights are drawn)."""
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def host_available_bytes() -> int:
    """MemAvailable of /proc/meminfo (0 where there is none)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            return int(value.split()[0]) * 1024
    return 0


def spread_hint(visible: int, most_ranks: int) -> str:
    """Without --gpus the workers share one card's worth (cuda:0..T-1) even where more cards
    are visible: the plan line says so (spreading them unasked could take cards others use)."""
    if visible <= most_ranks:
        return ""
    return f"; {visible} GPUs visible: --gpus all gives each worker cards of its own"


def _check_gpus_device(gpus: GpuRequest, device: str) -> None:
    """`--gpus` places workers on CUDA cards that each sees as cuda:0..: a CPU device or
    another card index contradicts it."""
    if device == "cpu":
        raise UsageError(f"--gpus {gpus.text}: the workers run on the CPU (--device cpu); "
                         "drop one of the two")  # fmt: skip
    if device.partition(":")[2] not in ("", "0"):
        raise UsageError(f"--device {device}: with --gpus each worker sees only its own cards, "
                         "as cuda:0..; give --device cuda or leave it out")  # fmt: skip


def laid_out(spec: ClusterSpec, choice: LayoutChoice) -> ClusterSpec:
    """`spec` with the choice's workers: P and D at its fraction, or one colocated worker; on
    the choice's cards."""
    share = ("--memory-fraction", f"{choice.memory_fraction:g}") if choice.memory_fraction else ()
    spec = dataclasses.replace(spec, placement=choice.placement)
    if choice.layout == COLOCATED:
        return dataclasses.replace(spec, num_prefill=0, num_decode=1,
                                   decode_args=(*spec.decode_args, "--role", "colocated"))  # fmt: skip
    return dataclasses.replace(spec, prefill_args=(*spec.prefill_args, *share),
                               decode_args=(*spec.decode_args, *share))  # fmt: skip
