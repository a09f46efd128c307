"""`fairness.png`: for runs whose requests carry clients, the difference in
weighted tokens served between the first two clients (by name), counted from
the start of each stretch in which both are backlogged, step by step, one
line per configuration (its first run), with VTC's bound drawn at plus and
minus its value. See lab/fairness.py for the measure."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from servelab.lab.fairness import contended_gap, service_curves
from servelab.lab.plots import first_run, legend_below, pyplot, save
from servelab.lab.runs import Configuration


def _weights(run) -> tuple[float, float]:
    node = (run.results.get("config") or {}).get("scheduler") or {}
    return float(node.get("w_prompt", 1.0)), float(node.get("w_output", 2.0))


def plot_fairness(configs: Sequence[Configuration], path: Path) -> bool:
    """Draws the gap over time; False (nothing drawn) when no run has two clients."""
    lines = []
    for config in configs:
        run = first_run(config)
        if run is None or "client_service_gap_max" not in run.summary:
            continue
        clients, cumulative, backlog = service_curves(run.requests(), run.steps(), *_weights(run))
        if len(clients) < 2:
            continue
        lines.append((config.label, clients, contended_gap(cumulative, backlog), run.summary))
    if not lines:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bounds = set()
    for label, _clients, gap, summary in lines:
        ax.plot(np.arange(len(gap)), gap, label=label, linewidth=1.5)
        bounds.add(float(summary.get("client_service_bound") or 0.0))
    for bound in sorted(b for b in bounds if b):
        for sign in (1, -1):
            ax.axhline(sign * bound, color="black", linestyle="--", linewidth=1,
                       label=f"VTC bound ±{bound:g}")  # fmt: skip
    a, b = lines[0][1][:2]
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel(f"service({a}) − service({b}), weighted tokens")
    ax.set_title("Service gap between backlogged clients (blank: not both backlogged)")
    legend_below(fig, [ax], columns=3)
    save(fig, path)
    return True
