"""`goodput.png`, for a sweep over request rates with an SLO: each configuration's goodput
(requests meeting the SLO per second of the run) against the offered rate, the capacity the
report's table gives marked (dashed); the offered rate is drawn for scale (a run's seconds
include its drain after the last arrival, so goodput stays below it even when every request
meets the SLO). When the runs moved KV between prefill and decode instances (a
disaggregated cluster), a second panel draws the transfer's time on the link (p50) and its
wait for admission at the decode instance (p99) against the rate.
Registered in lab/plots_registry.py."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from servelab.lab.estimates import estimate
from servelab.lab.plots import log_axis, pyplot, save
from servelab.lab.plots_load import rate_families
from servelab.lab.runs import Configuration
from servelab.lab.slo import capacity


def plot_goodput(configs: Sequence[Configuration], path: Path, slo: Mapping | None) -> bool:
    families = rate_families(configs)
    if not families or not slo:
        return False
    moved = {
        label: points
        for label, points in families.items()
        if any(_value(config, "kv_transfers") > 0 for _, config in points)
    }
    plt = pyplot()
    fig, axes = plt.subplots(1, 2 if moved else 1, figsize=(13 if moved else 7, 5), squeeze=False)
    goodput_ax = axes[0][0]
    swept = sorted({rate for points in families.values() for rate, _ in points})
    goodput_ax.plot(swept, swept, color="grey", linestyle=":", linewidth=1,
                    label="offered rate")  # fmt: skip
    capacities = {row["configuration"]: row["capacity_rps"] for row in capacity(configs, slo)}
    for i, (label, points) in enumerate(families.items()):
        color = f"C{i % 10}"
        rates = [rate for rate, _ in points]
        goodput_ax.plot(rates, [_value(c, "goodput_rps") for _, c in points], "-o", ms=3,
                        color=color, label=label)  # fmt: skip
        best = capacities.get(label)
        if best is not None:
            goodput_ax.axvline(best, color=color, linestyle="--", linewidth=0.8, alpha=0.7)
    goodput_ax.set_xlabel("request rate (req/s)")
    goodput_ax.set_ylabel("goodput (req/s meeting the SLO)")
    targets = ", ".join(f"{k} ≤ {v:g}" for k, v in slo.items() if k != "percentile")
    goodput_ax.set_title(f"goodput ({targets}); dashed: capacity at {slo['percentile']:g}%")
    goodput_ax.grid(True, alpha=0.3)
    goodput_ax.legend(loc="upper left", frameon=False, fontsize="small")
    if moved:
        _transfer_panel(axes[0][1], moved, families)
    fig.suptitle("Goodput against load")
    fig.tight_layout()
    save(fig, path)
    return True


def _transfer_panel(ax, moved: Mapping, families: Mapping) -> None:
    for label, points in moved.items():
        color = f"C{list(families).index(label) % 10}"
        rates = [rate for rate, _ in points]
        for figure, style, name in (("transfer_ms_p50", ":", "transfer p50"),
                                    ("transfer_wait_ms_p99", "-", "wait for admission p99")):  # fmt: skip
            ax.plot(rates, [_value(c, figure) for _, c in points], style, marker="o", ms=3,
                    color=color, label=f"{label}: {name}")  # fmt: skip
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("ms (log)")
    log_axis(ax, "y")
    ax.set_title("KV transfer: the link's time (dotted) and the decode instance's admission wait")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="center right", frameon=False, fontsize="x-small")


def _value(config: Configuration, figure: str) -> float:
    value = estimate(config, figure).mean
    return math.nan if value is None else value  # nan > 0 is False: a figure a run lacks
