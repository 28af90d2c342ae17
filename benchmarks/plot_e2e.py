"""Plots of the end-to-end results (issue 12): disaggregated against colocated per request rate.

    python -m benchmarks.plot_e2e benchmarks/results/e2e-h200.json docs/e2e-h200.svg

Three panels from `bench_e2e.py`'s summary (either `e2e-summary.json` or the committed results
file): TTFT (median and p90) and TPOT (median and p90) against the offered request rate, and
goodput under the run's SLO. Needs matplotlib (not a serving dependency).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODES = (("disaggregated", "tab:blue"), ("colocated", "tab:orange"))


def series(summary: dict, mode: str, key: str) -> tuple[list[float], list[float]]:
    """(request rates, values of `key`) over the mode's sweep, rates ascending."""
    points = sorted(
        (float(r["request_rate"]), r.get(key))
        for r in summary.get(mode, {}).get("sweep", [])
        if r.get(key) is not None
    )
    return [p[0] for p in points], [float(p[1]) for p in points]


def plot(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = (
        ("TTFT (ms)", ("median_ttft_ms", "p90_ttft_ms"), True),
        ("TPOT (ms)", ("median_tpot_ms", "p90_tpot_ms"), False),
        ("goodput (requests/s)", ("request_goodput",), False),
    )
    for ax, (label, keys, log) in zip(axes, panels):
        for mode, color in MODES:
            for key, style in zip(keys, ("-o", "--")):
                rates, values = series(summary, mode, key)
                if rates:
                    name = mode if len(keys) == 1 else f"{mode} {key.split('_')[0]}"
                    ax.plot(rates, values, style, color=color, label=name)
        ax.set_xscale("log", base=2)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("offered request rate (requests/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    hf = summary.get("transformers") or {}
    if "tpot_b1_ms" in hf:
        axes[1].axhline(hf["tpot_b1_ms"], color="gray", lw=0.8, ls=":",
                        label="transformers, batch 1")  # fmt: skip
        axes[1].legend(fontsize=7)
    fig.suptitle(f"dsv4-serve end to end, {summary.get('card', '')} {summary.get('date', '')}",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("summary", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    plot(json.loads(args.summary.read_text()), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
