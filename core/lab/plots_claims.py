"""`claims.png`: one panel per claim, one row per configuration (pair) it was
stated for: the estimate with its 95% interval as a point and whisker, the
bound dashed, and beside it n and the verdict. A ratio is drawn on a log axis
centred on 1 (a fold-change up looks as large as the same fold-change down,
and 0.987 against a bound of 0.95 is visible), with rows labelled "A vs B".
Titles wrap instead of being cut."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

from servelab.lab.claims import ClaimResult
from servelab.lab.plots import pyplot, save

MAX_CLAIM_PANELS = 12
COLORS = {"holds": "tab:green", "fails": "tab:red", "indicative": "tab:orange"}


def _ratio_limits(claims: Sequence[ClaimResult], bound: float) -> tuple[float, float]:
    """Symmetric log limits around 1 that show every interval and the bound."""
    reach = abs(math.log(bound)) if bound > 0 else 0.0
    for claim in claims:
        value = claim.bars[0][1]
        for x in (value.low, value.mean, value.high):
            if math.isfinite(x) and x > 0:
                reach = max(reach, abs(math.log(x)))
    reach = max(reach * 1.25, math.log(1.05))
    return math.exp(-reach), math.exp(reach)


FOLDS = (1 / 16, 1 / 8, 1 / 4, 1 / 3, 1 / 2, 2 / 3, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 3, 4, 8, 16)
# which fold-changes a crowded axis keeps first: doublings and halvings, then the rest
FOLD_PRIORITY = (2, 1 / 2, 4, 1 / 4, 8, 1 / 8, 16, 1 / 16, 1.5, 2 / 3, 3, 1 / 3, 1.25, 0.8,
                 1.1, 0.9)  # fmt: skip
LABEL_GAP_PX = 6  # at least this much space between two tick labels


def ratio_axis(ax, low: float, high: float) -> None:
    """A log x axis from low to high; its ticks are set by `ratio_ticks` once the figure's
    layout gives the axis its width."""
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log")
    ax.set_xlim(low, high)
    ax.xaxis.set_minor_locator(NullLocator())


def ratio_ticks(ax, bound: float) -> None:
    """Ticks the bound, then 1, then plain fold-changes, each only where its label keeps
    LABEL_GAP_PX from every label already placed (labels measured as drawn)."""
    renderer = ax.figure.canvas.get_renderer()
    low, high = ax.get_xlim()
    box = ax.get_window_extent(renderer)
    span = math.log(high / low)
    from matplotlib import rcParams
    from matplotlib.font_manager import FontProperties

    font = FontProperties(size=rcParams["xtick.labelsize"])

    def extent(value: float) -> tuple[float, float]:
        width = renderer.get_text_width_height_descent(f"{value:.3g}", font, ismath=False)[0]
        x = box.x0 + box.width * math.log(value / low) / span
        return x - width / 2 - LABEL_GAP_PX / 2, x + width / 2 + LABEL_GAP_PX / 2

    placed: dict[float, tuple[float, float]] = {}
    for value in (bound, 1.0, *FOLD_PRIORITY):
        if not low <= value <= high or value in placed:
            continue
        left, right = extent(value)
        if all(right <= a or left >= b for a, b in placed.values()):
            placed[value] = (left, right)
    ticks = sorted(placed)
    ax.set_xticks(ticks, [f"{t:.3g}" for t in ticks])


def row_label(text: str) -> str:
    """A long "A vs B" row label on two lines, so the panel keeps its width."""
    return text.replace(" vs ", "\nvs ", 1) if len(text) > 40 else text


def plot_claims(claims: Sequence[ClaimResult], path: Path) -> bool:
    panels: dict[tuple, list[ClaimResult]] = {}
    for claim in claims:
        if claim.bars and claim.op:
            key = (claim.text.split(" — ")[0], claim.figure, claim.op, claim.bound)
            panels.setdefault(key, []).append(claim)
    if not panels:
        return False
    panels = dict(list(panels.items())[:MAX_CLAIM_PANELS])
    plt = pyplot()
    heights = [len(group) + 2.2 for group in panels.values()]
    ratio_axes = []
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 0.42 * sum(heights) + 0.8),
                             squeeze=False, gridspec_kw={"height_ratios": heights})  # fmt: skip
    for ax, ((heading, figure, op, bound), group) in zip(axes[:, 0], panels.items()):
        ratio = op.startswith("ratio")
        for y, claim in enumerate(group):
            value = claim.bars[0][1]
            finite = math.isfinite(value.low) and math.isfinite(value.high)
            err = [[value.mean - value.low], [value.high - value.mean]] if finite else None
            color = COLORS.get(claim.verdict, "tab:gray")
            ax.errorbar(value.mean, y, xerr=err, fmt="o", color=color, capsize=5, ms=7, lw=2)
            verdict = claim.verdict or "cannot check"
            n = "exact" if value.exact else f"n={value.n}"
            ax.annotate(f"{value.mean:.3g}{'×' if ratio else ''}  {n}  {verdict}",
                        (1.01, y), xycoords=("axes fraction", "data"), va="center",
                        color=color, fontsize=10)  # fmt: skip
        ax.axvline(bound, color="black", linestyle="--", linewidth=1.2)
        if ratio:
            ax.axvline(1.0, color="0.5", linewidth=0.8)
            ratio_axis(ax, *_ratio_limits(group, bound))
            ratio_axes.append((ax, bound))
        ax.set_yticks(range(len(group)), [row_label(c.bars[0][0]) for c in group], fontsize=9)
        ax.set_ylim(len(group) - 0.5, -0.5)
        ax.grid(True, axis="x", which="both", alpha=0.3)
        what = f"{figure} ratio (log; grey: 1, no change)" if ratio else figure
        ax.set_xlabel(f"{what}; dashed: the bound {bound:g}")
        ax.set_title("\n".join(textwrap.wrap(heading, 80)), fontsize=11, loc="left")
    exact = all(claim.bars[0][1].exact for group in panels.values() for claim in group)
    drawn = "exact value (no interval: a counted or virtual-clock figure)" if exact else (
        "estimate and 95% interval")  # fmt: skip
    fig.suptitle(f"Claims: {drawn} against the bound\n"
                 "(green: holds, red: fails, grey: inconclusive, orange: indicative)")  # fmt: skip
    fig.tight_layout()
    for ax, bound in ratio_axes:  # the layout has set each axis's width: tick what fits
        ratio_ticks(ax, bound)
    save(fig, path)
    return True
