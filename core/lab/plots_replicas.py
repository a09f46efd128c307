"""`replicas.png`, for cluster runs: how the router spread the requests and what it cost.
Left, the requests routed to each replica (one bar per configuration at each replica, its
load imbalance in the legend: the most on one replica over the mean); right, the median time
to first token of the requests each replica served, its p99 as a tick above. A replica that
got more requests than the others is fine where its first tokens came as fast: concentrating
on a replica whose cache already holds the prompts can save more than it queues. Read from
the first repeat's requests.csv (its `replica` column; a disaggregated run's
`prefill_replica`). Drawn by lab/plots_registry.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from servelab.lab.plots import first_run, legend_below, pyplot, save
from servelab.lab.runs import Configuration

COLUMNS = (("replica", "replica"), ("prefill_replica", "prefill instance"))


def plot_replicas(configs: Sequence[Configuration], path: Path) -> bool:
    """Draws the plot at `path`; False when no configuration ran on several replicas."""
    shown = [(config, *rows) for config in configs if (rows := replica_rows(config))]
    if not shown:
        return False
    plt = pyplot()
    fig, (routed_ax, ttft_ax) = plt.subplots(1, 2, figsize=(13, 4.6))
    count = max(max(r[0] for r in rows) + 1 for _, rows, _ in shown)
    width = 0.8 / len(shown)
    for i, (config, rows, _) in enumerate(shown):
        x = np.arange(count) + (i - (len(shown) - 1) / 2) * width
        routed = np.bincount([r[0] for r in rows], minlength=count)
        imbalance = routed.max() / routed.mean() if routed.mean() else 1.0
        color = f"C{i % 10}"
        routed_ax.bar(x, routed, width, color=color, alpha=0.8,
                      label=f"{config.label} (load imbalance {imbalance:.2f})")  # fmt: skip
        ttfts = [[1000.0 * t for r, t in rows if r == k and t is not None] for k in range(count)]
        median = [float(np.median(t)) if t else np.nan for t in ttfts]
        p99 = [float(np.percentile(t, 99)) if t else np.nan for t in ttfts]
        ttft_ax.bar(x, median, width, color=color, alpha=0.8)
        ttft_ax.plot(x, p99, "_", color="black", ms=10, mew=1.5)
    what = shown[0][2]
    for ax in (routed_ax, ttft_ax):
        ax.set_xticks(range(count), [str(k) for k in range(count)])
        ax.set_xlabel(what)
        ax.grid(True, axis="y", alpha=0.3)
    routed_ax.set(ylabel="requests routed", title=f"Requests routed to each {what}")
    ttft_ax.set(ylabel="time to first token (ms)",
                title=f"Time to first token on each {what} (bar: median, tick: p99)")  # fmt: skip
    clock = "virtual time" if all(c.deterministic for c, _, _ in shown) else "first repeat"
    fig.suptitle(f"How the router spread the requests ({clock})")
    fig.tight_layout()
    legend_below(fig, [routed_ax], columns=2)
    save(fig, path)
    return True


def replica_rows(config: Configuration) -> tuple[list[tuple[int, float | None]], str] | None:
    """(replica, ttft in seconds) of each request of the first repeat, and what a replica is
    called; None when the run is not a cluster's."""
    run = first_run(config)
    rows = run.requests() if run else []
    for column, name in COLUMNS:
        if rows and all(isinstance(r.get(column), int) for r in rows):
            return [(r[column], r.get("ttft")) for r in rows], name
    return None
