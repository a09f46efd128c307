"""`latency_vs_load.png`, for a sweep over request rates: p50 and p99 TTFT and
inter-token latency against the rate with interval bands and the SLO's
targets, the SLO attainment against the rate (what capacity is decided on),
and throughput against latency. The plots are drawn by lab/plots_registry.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from servelab.lab.estimates import estimate
from servelab.lab.plots import log_axis, pyplot, save
from servelab.lab.runs import Configuration
from servelab.lab.slo import RATE_KEY

LOAD_FIGURES = (("ttft", "time to first token"), ("itl", "inter-token latency"))


def plot_latency_vs_load(
    configs: Sequence[Configuration], path: Path, slo: Mapping | None = None
) -> bool:
    """For a sweep over workload.rate: p50 and p99 TTFT and inter-token latency
    against the rate, one line per configuration, 95% bands, each SLO target
    drawn on its own panel; the SLO attainment against the rate with the share
    it must reach; output throughput against p99 TTFT."""
    families = rate_families(configs)
    if not families:
        return False
    plt = pyplot()
    fig, grid = plt.subplots(2, 2, figsize=(13, 9))
    latency_axes, attainment_ax, tradeoff_ax = grid[0], grid[1, 0], grid[1, 1]
    swept = sorted({rate for points in families.values() for rate, _ in points})
    for i, (label, points) in enumerate(families.items()):
        color = f"C{i % 10}"
        rates = [rate for rate, _ in points]
        for ax, (kind, _) in zip(latency_axes, LOAD_FIGURES):
            for q, style in (("50", ":"), ("99", "-")):
                values = [estimate(config, f"{kind}_p{q}_ms") for _, config in points]
                ax.plot(rates, [v.mean for v in values], style, color=color, marker="o", ms=3,
                        label=f"{label} p{q}")  # fmt: skip
                ax.fill_between(rates, [v.low for v in values], [v.high for v in values],
                                color=color, alpha=0.15, linewidth=0)  # fmt: skip
        if slo:
            values = [estimate(config, "slo_attainment_pct") for _, config in points]
            attainment_ax.plot(rates, [v.mean for v in values], "-o", color=color, ms=3)
            attainment_ax.fill_between(rates, [v.low for v in values],
                                       [min(v.high, 100.0) for v in values], color=color,
                                       alpha=0.15, linewidth=0)  # fmt: skip
        throughput = [estimate(config, "output_tok_s").mean for _, config in points]
        ttft99 = [estimate(config, "ttft_p99_ms").mean for _, config in points]
        tradeoff_ax.plot(throughput, ttft99, "-o", color=color, ms=3, label=f"{label} p99")
    for ax, (kind, title) in zip(latency_axes, LOAD_FIGURES):
        _rate_axis(ax, swept)
        ax.set_ylabel(f"{title} (ms, log)")
        log_axis(ax, "y")
        target = (slo or {}).get(f"{kind}_ms")  # tpot_ms is a per-request mean: not a gap's
        if target:
            ax.axhline(target, color="black", linestyle="--", linewidth=1,
                       label=f"SLO {kind}_ms ≤ {target:g}")  # fmt: skip
            ax.legend(handles=[ax.get_lines()[-1]], loc="upper left", frameon=False)
        ax.set_title(f"{title}: p50 (dotted), p99 (solid), 95% bands")
        ax.grid(True, alpha=0.3)
    if slo:
        _rate_axis(attainment_ax, swept)
        attainment_ax.axhline(slo["percentile"], color="black", linestyle="--", linewidth=1)
        attainment_ax.set_ylim(0, 105)
        attainment_ax.set_ylabel("requests meeting the SLO (%)")
        targets = ", ".join(f"{k} ≤ {v:g}" for k, v in slo.items() if k != "percentile")
        attainment_ax.set_title(f"SLO attainment ({targets}); dashed: {slo['percentile']:g}%")
        attainment_ax.grid(True, alpha=0.3)
    else:
        attainment_ax.set_visible(False)
    tradeoff_ax.set_xlabel("output tokens / s")
    tradeoff_ax.set_ylabel("p99 time to first token (ms, log)")
    log_axis(tradeoff_ax, "y")
    tradeoff_ax.set_title("throughput against latency")
    tradeoff_ax.grid(True, alpha=0.3)
    fig.suptitle("Latency and SLO attainment against load")
    fig.tight_layout()
    lines = [line for line in latency_axes[0].get_lines() if not line.get_label().startswith("SLO")]
    fig.legend(handles=lines, loc="upper center", bbox_to_anchor=(0.5, 0.0),
               ncol=min(4, len(lines)), frameon=False)  # fmt: skip
    save(fig, path)
    return True


def _rate_axis(ax, swept: Sequence[float]) -> None:
    log_axis(ax, "x")  # swept rates usually double
    ax.set_xticks(swept, [f"{rate:g}" for rate in swept])
    ax.set_xlabel("request rate (req/s, log)")


def rate_families(configs: Sequence[Configuration]) -> dict[str, list[tuple[float, Configuration]]]:
    """Configurations swept over workload.rate, grouped by their other choices,
    each family's points in rate order (at least two rates)."""
    families: dict[str, list[tuple[float, Configuration]]] = {}
    for config in configs:
        if RATE_KEY not in config.swept:
            continue
        label = ", ".join(f"{k}={v}" for k, v in config.swept.items() if k != RATE_KEY) or "all"
        families.setdefault(label, []).append((float(config.swept[RATE_KEY]), config))
    return {k: sorted(v, key=lambda p: p[0]) for k, v in families.items() if len(v) > 1}
