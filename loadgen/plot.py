"""`--plot FILE.png`: latency CDFs (one line per rate) and, for sweeps, the latency-throughput
trade-off: one point per rate of p50 / p99 TPOT against output tokens/s and of p50 / p99 TTFT
against requests/s, the Pareto frontier (no other rate has both more throughput and less
latency) drawn through the p99 points. matplotlib (the `plot` extra) is imported lazily, Agg
backend; the CLI checks for it before the run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from loadgen.metrics import METRIC_NAMES, METRIC_TITLES, RunSummary, request_latency
from loadgen.runner import RunResult


def latency_samples_ms(result: RunResult, metric: str) -> list[float]:
    """Per-request (ttft, tpot, e2el) or pooled (itl) samples of successful requests."""
    out: list[float] = []
    for record in result.records:
        lat = request_latency(record)
        if lat is None:
            continue
        if metric == "itl":
            out.extend(lat.itls_ms)
        elif metric == "tpot":
            if lat.tpot_ms is not None:
                out.append(lat.tpot_ms)
        else:
            out.append(getattr(lat, f"{metric}_ms"))
    return sorted(out)


def _rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def write_plot(path: str, results: Sequence[RunResult], summaries: Sequence[RunSummary]) -> None:
    """Write the figure to `path` (PNG). Raises ImportError when matplotlib is missing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    is_sweep = len(results) > 1
    nrows = 3 if is_sweep else 2
    fig, axes = plt.subplots(nrows, 2, figsize=(11, 4 * nrows), squeeze=False)
    for ax, metric in zip(axes[:2].flat, METRIC_NAMES):
        for result in results:
            samples = latency_samples_ms(result, metric)
            if samples:
                ys = [(i + 1) / len(samples) for i in range(len(samples))]
                ax.step(samples, ys, where="post", label=f"rate {_rate_label(result.request_rate)}")
        ax.set_title(f"{METRIC_TITLES[metric]} ({metric.upper()}) CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    if is_sweep:
        pairs = (("tpot", "output_throughput", "output tokens/s"),
                 ("ttft", "request_throughput", "requests/s"))  # fmt: skip
        for ax, (metric, rate_attr, unit) in zip(axes[2], pairs):
            _pareto_panel(ax, summaries, metric, rate_attr)
            ax.set_title(f"{metric.upper()} vs throughput (one point per rate)")
            ax.set_xlabel(unit)
            ax.set_ylabel(f"{metric.upper()} (ms)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def pareto_frontier(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (throughput, latency) points no other point beats on both (more throughput and
    less latency), by increasing throughput."""
    best: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (-p[0], p[1])):
        if not best or y < best[-1][1]:
            best.append((x, y))
    return best[::-1]


def _pareto_panel(ax: Any, summaries: Sequence[RunSummary], metric: str, rate_attr: str) -> None:
    """Median and p99 of `metric` against `rate_attr` (a RunSummary throughput), labelled by
    request rate, and the Pareto frontier of the p99 points."""
    pick = {"p50": lambda st: st.median_ms, "p99": lambda st: dict(st.percentiles_ms).get(99.0)}
    for (name, latency_of), style in zip(pick.items(), ("o", "s")):
        points = [
            (getattr(s, rate_attr), latency, _rate_label(s.request_rate))
            for s in summaries
            if (latency := latency_of(s.stat(metric))) is not None
        ]
        ax.plot([x for x, _, _ in points], [y for _, y, _ in points], style, label=name)
        for x, y, label in points:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    front = pareto_frontier([(x, y) for x, y, _ in points])  # the p99 points, drawn last
    ax.plot([x for x, _ in front], [y for _, y in front], "--o", mfc="none", ms=12,
            label="Pareto frontier (p99)")  # fmt: skip
