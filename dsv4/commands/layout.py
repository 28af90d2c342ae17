"""`dsv4 up --layout`: on one card, prefill and decode workers side by side, or one colocated
worker doing both.

`dsv4 up` starts every worker on the same device (cuda:0, or the `--device cuda:N` given; a
worker of T ranks on cuda:0..T-1, so each of those cards holds one rank of every worker), and
each worker holds its own copy of the weights. `choose_layout` decides from the plan each
worker's start-up computes (`dsv4.worker.fit.device_plan`: same arithmetic, same refusals):

- disaggregated: the N workers share the card, each at `--memory-fraction F/N` (F: the
  configured `cache.memory_fraction`); refused unless each fits its share (offloading experts
  where `--host-memory-gib` allows it, as the worker's own plan would).
- colocated: one worker at F; refused unless it fits (offload as configured).
- auto: disaggregated when every worker fits its share without offload, else colocated; the
  plan line says why.

No card to plan (a CPU device without `--device-memory-gib`): nothing is checked and auto is
disaggregated, as `dsv4 up` always was. On CPU, `--device-memory-gib G` is one card of G GiB.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass

from dsv4.commands.cluster import ClusterSpec, service_config
from dsv4.config import ServeConfig
from dsv4.config.model import ModelConfig
from dsv4.config.resolve import resolve_auto
from dsv4.errors import UsageError
from dsv4.plan import MemoryPlan, PlanDoesNotFit, plan_memory
from dsv4.worker.fit import GIB, device_plan, planned_model_config, size_text, startup_request

LAYOUTS = ("auto", "disaggregated", "colocated")
DISAGGREGATED, COLOCATED = "disaggregated", "colocated"
MIN_FRACTION = 0.01  # cache.memory_fraction's own minimum
NO_CARD = "no card to plan (a CPU device: give --device-memory-gib G to plan G GiB as one card)"


@dataclass(frozen=True)
class LayoutChoice:
    layout: str  # disaggregated | colocated
    memory_fraction: float  # each worker's cache.memory_fraction; 0: as configured (no card)
    reason: str  # why, in one line

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
) -> LayoutChoice:
    """The layout of `num_prefill` P + `num_decode` D workers (resolved configs, as their
    start-up sees them) on one card of `card_bytes` (0: none to plan). Pure arithmetic; raises
    `PlanDoesNotFit` (one line) for a layout that cannot fit."""
    if requested not in LAYOUTS:
        raise UsageError(f"--layout {requested}: give one of {', '.join(LAYOUTS)}")
    fraction = decode.cache.memory_fraction
    if not card_bytes:
        return LayoutChoice(COLOCATED if requested == COLOCATED else DISAGGREGATED, 0.0, NO_CARD)
    if requested == COLOCATED:
        whole = _fit(decode, model, card_bytes, fraction, "--layout colocated")
        return LayoutChoice(COLOCATED, fraction, f"as asked: one worker, {_usage(whole)}")
    workers = num_prefill + num_decode
    share = float(f"{fraction / workers:.6g}")  # what the workers' flag will say
    pools = ((prefill, "prefill"), (decode, "decode"))
    sharing = (f"{num_prefill} prefill + {num_decode} decode worker{'s' * (workers > 2)} "
               f"share the card at --memory-fraction {share:g} each")  # fmt: skip
    if share < MIN_FRACTION:
        raise PlanDoesNotFit(f"--layout {requested}: {sharing}, below {MIN_FRACTION:g}")
    if requested == DISAGGREGATED:
        plans = [_fit(cfg, model, card_bytes, share,
                      f"--layout disaggregated: {sharing}; the {role} worker's plan")
                 for cfg, role in pools]  # fmt: skip
        return LayoutChoice(DISAGGREGATED, share, _shared_reason(sharing, plans))
    try:
        plans = [_fit(cfg, model, card_bytes, share, "", offload=False) for cfg, _ in pools]
        return LayoutChoice(DISAGGREGATED, share, _shared_reason(sharing, plans))
    except PlanDoesNotFit:
        pass
    prefix = (f"--layout auto: neither {workers} workers sharing the card nor one colocated "
              "worker fits; the colocated worker's plan")  # fmt: skip
    whole = _fit(decode, model, card_bytes, fraction, prefix)
    copies = plan_memory(startup_request(_at(decode, share, offload=False), model, card_bytes))
    return LayoutChoice(COLOCATED, fraction, _colocated_reason(copies, whole, workers, card_bytes))


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


def _colocated_reason(copies: MemoryPlan, whole: MemoryPlan, workers: int, card: int) -> str:
    """`copies`: one worker's plan at its share, without offload; `whole`: the colocated one."""
    fraction = whole.request.memory_fraction
    return (f"{workers} copies of the weights ({workers} x {size_text(copies.weight_bytes)}) + "
            f"KV/workspaces ({workers} x {size_text(_reserve(copies))}) do not fit "
            f"{size_text(card)} x {fraction:g} ({workers} x {size_text(copies.usable_bytes)} "
            f"usable); one worker at --memory-fraction {fraction:g}{_offloaded(whole)}")  # fmt: skip


def plan_layout(spec: ClusterSpec, requested: str) -> tuple[ClusterSpec, LayoutChoice]:
    """`spec` laid out as `requested` on the card its workers will use, and the choice."""
    configs = {role: service_config(("--model", spec.model_dir, *spec.service_args, *args),
                                    os.environ)
               for role, args in (("prefill", spec.prefill_args), ("decode", spec.decode_args))}  # fmt: skip
    device = configs["decode"].model.device
    total = 0 if device == "cpu" else cuda_total_bytes(int(device.partition(":")[2] or 0))
    resolved = {role: resolve_auto(c, has_cuda=total > 0, hostname="up", pid=0)
                for role, c in configs.items()}  # fmt: skip
    decode = resolved["decode"]
    card = int(decode.model.device_memory_gib * GIB)
    if not card and decode.model.device.startswith("cuda"):
        card = total
    choice = choose_layout(
        requested, prefill=resolved["prefill"], decode=decode,
        model=planned_model_config(decode), card_bytes=card,
        num_prefill=spec.num_prefill, num_decode=spec.num_decode,
    )  # fmt: skip
    return laid_out(spec, choice), choice


def laid_out(spec: ClusterSpec, choice: LayoutChoice) -> ClusterSpec:
    """`spec` with the choice's workers: P and D at its fraction, or one colocated worker."""
    share = ("--memory-fraction", f"{choice.memory_fraction:g}") if choice.memory_fraction else ()
    if choice.layout == COLOCATED:
        return dataclasses.replace(spec, num_prefill=0, num_decode=1,
                                   decode_args=(*spec.decode_args, "--role", "colocated"))  # fmt: skip
    return dataclasses.replace(spec, prefill_args=(*spec.prefill_args, *share),
                               decode_args=(*spec.decode_args, *share))  # fmt: skip


# In a child process: the launcher itself never opens a CUDA context (it would hold device
# memory for as long as the cluster runs).
_PROBE = (
    "import sys, torch; i = int(sys.argv[1]); c = torch.cuda;"
    " print(c.get_device_properties(i).total_memory"
    " if c.is_available() and i < c.device_count() else 0)"
)


def cuda_total_bytes(index: int) -> int:
    """Total memory of cuda:`index` as the workers will see it; 0 without such a device."""
    done = subprocess.run([sys.executable, "-c", _PROBE, str(index)], capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    try:
        return int(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0
