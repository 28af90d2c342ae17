"""Prometheus series of routed experts: popularity per MoE layer, and the offload pool's traffic.

Popularity (with `metrics.routing_stats`): the worker counts every routed selection per (layer,
expert) on the device; a scrape copies the [L, E] counts to the host once and exports, per layer
(~44 series each, never one per expert):
- `dsv4_expert_selections_total{layer}`: routed selections (tokens x top-k);
- `dsv4_expert_top_share{layer}`: the share of them taken by the layer's most selected 10% of
  experts (0.1 under uniform routing; what keeping those experts resident would hit).
Layer "mtp" is the MTP layer.

The offload's own series (hit rate, fetches, bytes) are `dsv4.serving.metrics.ExpertCollector`'s,
read from the offload's counters at scrape time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

TOP_FRACTION = 0.1  # the "top" of dsv4_expert_top_share: the most selected 10% of experts


def top_share(counts: list[int], fraction: float = TOP_FRACTION) -> float:
    """Share of the selections taken by the ceil(fraction * E) most selected experts."""
    total = sum(counts)
    if not total:
        return 0.0
    n = max(1, math.ceil(len(counts) * fraction))
    return sum(sorted(counts, reverse=True)[:n]) / total


class ExpertSelectionCollector(Collector):
    """Reads `snapshot()` ([L][E] counts, or None while none are kept) at scrape time;
    `num_main_layers`: rows past it are the MTP layer."""

    def __init__(self, snapshot: Callable[[], list[list[int]] | None], num_main_layers: int):
        self._snapshot, self._num_main = snapshot, num_main_layers

    def collect(self) -> Iterator[Metric]:
        rows = self._snapshot()
        if rows is None:
            return
        total = CounterMetricFamily("dsv4_expert_selections", "Routed expert selections (tokens x top-k) per MoE layer", labels=("layer",))  # fmt: skip
        share = GaugeMetricFamily("dsv4_expert_top_share", "Share of a MoE layer's selections taken by its most selected 10% of experts", labels=("layer",))  # fmt: skip
        for i, row in enumerate(rows):
            label = (str(i) if i < self._num_main else "mtp",)
            total.add_metric(label, float(sum(row)))
            share.add_metric(label, top_share(row))
        yield total
        yield share
