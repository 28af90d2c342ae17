"""`--plot FILE.png`: latency CDFs (one line per rate) and, for sweeps, throughput and
goodput against the request rate. matplotlib (dev extra) is imported lazily, Agg backend."""

from __future__ import annotations

import math
from collections.abc import Sequence

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
        xs = list(range(len(summaries)))
        labels = [_rate_label(s.request_rate) for s in summaries]
        ax_req, ax_tok = axes[2]
        ax_req.plot(xs, [s.request_throughput for s in summaries], "o-", label="throughput")
        if any(s.request_goodput is not None for s in summaries):
            goodput = [s.request_goodput or 0.0 for s in summaries]
            ax_req.plot(xs, goodput, "s--", label="goodput")
        ax_req.set_title("Requests/s vs request rate")
        ax_req.set_ylabel("req/s")
        ax_tok.plot(xs, [s.output_throughput for s in summaries], "o-", label="output tok/s")
        ax_tok.plot(xs, [s.total_token_throughput for s in summaries], "^:", label="total tok/s")
        ax_tok.set_title("Token throughput vs request rate")
        ax_tok.set_ylabel("tok/s")
        for ax in (ax_req, ax_tok):
            ax.set_xticks(xs, labels)
            ax.set_xlabel("request rate (req/s)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
