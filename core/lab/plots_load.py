"""The report's comparison plots: each claim's figure per configuration with
its 95% interval and the bound drawn, and latency against request rate for a
rate sweep (p50 and p99 TTFT and inter-token latency, with interval bands,
and throughput against latency). `draw_plots` draws every plot a report has."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from servelab.lab.claims import ClaimResult
from servelab.lab.estimates import estimate
from servelab.lab.plots import (
    legend_below,
    log_axis,
    plot_batches,
    plot_kv_use,
    plot_latency_cdfs,
    plot_throughput,
    plot_timeline,
    pyplot,
    save,
)
from servelab.lab.plots_fairness import plot_fairness
from servelab.lab.runs import Configuration
from servelab.lab.slo import RATE_KEY

MAX_CLAIM_PANELS = 12
LOAD_FIGURES = (("ttft", "time to first token"), ("itl", "inter-token latency"))


def draw_plots(
    configs: Sequence[Configuration], claims: Sequence[ClaimResult], settings: Mapping, out: Path
) -> list[str]:
    """Draws every plot the report has data for; returns the files written."""
    finished = [c for c in configs if c.finished]
    if not finished:
        return []
    axis = settings.get("time_axis", "steps")
    plots = {
        "claims.png": lambda p: plot_claims(claims, p),
        "throughput.png": lambda p: plot_throughput(finished, p),
        "latency_vs_load.png": lambda p: plot_latency_vs_load(finished, p, settings.get("slo")),
        "latency_cdf.png": lambda p: plot_latency_cdfs(finished, p),
        "kv_util.png": lambda p: plot_kv_use(finished, p, axis),
        "batch.png": lambda p: plot_batches(finished, p, axis),
        "timeline.png": lambda p: plot_timeline(finished, p, axis),
        "fairness.png": lambda p: plot_fairness(finished, p),
    }
    written = []
    for name, draw in plots.items():
        if draw(out / name) is not False:
            written.append(name)
    return written


def plot_claims(claims: Sequence[ClaimResult], path: Path) -> bool:
    """One panel per claim: its figure (or ratio) for every configuration (pair)
    it was stated for, with 95% error bars, the bound as a dashed line, each bar
    coloured by its verdict."""
    panels: dict[tuple, list[ClaimResult]] = {}
    for claim in claims:
        if claim.bars and claim.op:
            key = (claim.text.split(" — ")[0], claim.figure, claim.op, claim.bound)
            panels.setdefault(key, []).append(claim)
    if not panels:
        return False
    panels = dict(list(panels.items())[:MAX_CLAIM_PANELS])
    plt = pyplot()
    columns = min(2, len(panels))
    rows = math.ceil(len(panels) / columns)
    heights = [max(len(group) for group in list(panels.values())[r * columns:(r + 1) * columns])
               for r in range(rows)]  # fmt: skip
    fig, axes = plt.subplots(
        rows, columns, figsize=(7 * columns, sum(0.45 * h + 1.3 for h in heights)),
        squeeze=False, gridspec_kw={"height_ratios": heights},
    )  # fmt: skip
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, ((heading, figure, op, bound), group) in zip(axes.flat, panels.items()):
        for y, claim in enumerate(group):
            _, value = claim.bars[0]
            finite = math.isfinite(value.low) and math.isfinite(value.high)
            err = [[value.mean - value.low], [value.high - value.mean]] if finite else None
            color = {"holds": "tab:green", "fails": "tab:red"}.get(claim.verdict, "tab:gray")
            ax.barh(y, value.mean, xerr=err, capsize=4, color=color, alpha=0.75, height=0.6)
        ax.axvline(bound, color="black", linestyle="--", linewidth=1)
        ax.set_yticks(range(len(group)), [_short(c.bars[0][0], 48) for c in group], fontsize=7)
        ax.invert_yaxis()
        ratio = op.startswith("ratio")
        ax.set_xlabel(f"{figure}{' ratio' if ratio else ''} (dashed: the bound)", fontsize=8)
        ax.set_title(_short(heading, 70), fontsize=9)
        ax.set_xlim(left=0)
    fig.suptitle("Claims: estimate with 95% interval against the bound "
                 "(green: holds, red: fails, grey: inconclusive)")  # fmt: skip
    fig.tight_layout()
    save(fig, path)
    return True


def _short(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def plot_latency_vs_load(
    configs: Sequence[Configuration], path: Path, slo: Mapping | None = None
) -> bool:
    """For a sweep over workload.rate: p50 and p99 TTFT and inter-token latency
    against the rate, one line per configuration, 95% bands; and output
    throughput against p99 TTFT."""
    families = rate_families(configs)
    if not families:
        return False
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for i, (label, points) in enumerate(families.items()):
        color = f"C{i % 10}"
        rates = [rate for rate, _ in points]
        for ax, (kind, _) in zip(axes[:2], LOAD_FIGURES):
            for q, style in (("50", ":"), ("99", "-")):
                values = [estimate(config, f"{kind}_p{q}_ms") for _, config in points]
                ax.plot(rates, [v.mean for v in values], style, color=color, marker="o", ms=3,
                        label=f"{label} p{q}")  # fmt: skip
                ax.fill_between(rates, [v.low for v in values], [v.high for v in values],
                                color=color, alpha=0.15, linewidth=0)  # fmt: skip
        throughput = [estimate(config, "output_tok_s").mean for _, config in points]
        ttft99 = [estimate(config, "ttft_p99_ms").mean for _, config in points]
        axes[2].plot(throughput, ttft99, "-o", color=color, ms=3, label=f"{label} p99")
    for ax, (kind, title) in zip(axes[:2], LOAD_FIGURES):
        log_axis(ax, "x")  # swept rates usually double
        swept = sorted({rate for points in families.values() for rate, _ in points})
        ax.set_xticks(swept, [f"{rate:g}" for rate in swept])
        ax.set_xlabel("request rate (req/s, log)")
        ax.set_ylabel(f"{title} (ms, log)")
        log_axis(ax, "y")
        target = (slo or {}).get(f"{kind}_ms") or (
            (slo or {}).get("tpot_ms") if kind == "itl" else None
        )
        if target:
            ax.axhline(target, color="black", linestyle="--", linewidth=1)
        ax.set_title(f"{title}: p50 (dotted), p99 (solid), 95% bands", fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[2].set_xlabel("output tokens / s")
    axes[2].set_ylabel("p99 time to first token (ms, log)")
    log_axis(axes[2], "y")
    axes[2].set_title("throughput against latency", fontsize=9)
    axes[2].grid(True, alpha=0.3)
    dashed = " (dashed: the SLO's TTFT target; its TPOT target on the inter-token panel)"
    fig.suptitle("Latency against load" + (dashed if slo else ""))
    fig.tight_layout()
    legend_below(fig, axes[:1], columns=4)
    save(fig, path)
    return True


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
