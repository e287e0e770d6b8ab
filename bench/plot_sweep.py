#!/usr/bin/env python3
"""Plot a duet-bench sweep: output throughput against latency, one labelled point per value.

Usage: bench/plot_sweep.py CSV PNG

CSV is what `duet-bench --sweep P=V1,V2,... --csv CSV` writes (columns sweep, value,
output_throughput, median_tpot_ms, median_ttft_ms, ...). The PNG has two panels sharing the
x axis (output tokens/s): median TPOT and median TTFT in ms, each point labelled with its sweep
value, so the knee where latency starts buying no more throughput is visible. Rows without a
throughput (no request completed) are left out and named on stderr. Exit 2 on a missing column
or no plottable row. Needs matplotlib (Debian: python3-matplotlib).
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")  # files only: no display on CI machines
import matplotlib.pyplot as plt  # noqa: E402

NEED = ("sweep", "value", "output_throughput", "median_tpot_ms", "median_ttft_ms")


def num(cell):
    try:
        return float(cell)
    except ValueError:
        return None


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    with open(argv[1], newline="") as f:
        rows = list(csv.DictReader(f))
    missing = [c for c in NEED if not rows or c not in rows[0]]
    if missing:
        print(f"plot_sweep: {argv[1]}: no rows or no column {', '.join(missing)}", file=sys.stderr)
        return 2
    pts = []
    for r in rows:
        x = num(r["output_throughput"])
        if x is None:
            print(f"plot_sweep: {r['sweep']}={r['value']}: no throughput, left out", file=sys.stderr)
            continue
        pts.append((r["value"], x, num(r["median_tpot_ms"]), num(r["median_ttft_ms"])))
    if not pts:
        print(f"plot_sweep: {argv[1]}: nothing to plot", file=sys.stderr)
        return 2
    fig, axes = plt.subplots(2, 1, sharex=True, figsize=(7, 7))
    for ax, col, name in ((axes[0], 2, "median TPOT (ms)"), (axes[1], 3, "median TTFT (ms)")):
        xy = [(p[1], p[col], p[0]) for p in pts if p[col] is not None]
        ax.plot([a for a, _, _ in xy], [b for _, b, _ in xy], marker="o")
        for a, b, label in xy:
            ax.annotate(label, (a, b), textcoords="offset points", xytext=(5, 5))
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    axes[1].set_xlabel("output throughput (tok/s)")
    axes[0].set_title(f"duet-bench sweep over {rows[0]['sweep']}")
    fig.tight_layout()
    fig.savefig(argv[2], format="png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
