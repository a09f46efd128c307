"""`speculation.png`, for a sweep of `proposer` (with `none` among its choices)
over a numeric axis, usually `engine.max_num_seqs`: where speculative decoding
stops paying. Left, each proposer's output tok/s over that of `proposer=none`
at the same point (a dashed line at 1: break-even), its mean accepted length
(tokens a verification produces: kept drafts + the target's own) in the legend;
right, every configuration's mean time per output token, `none`'s included.
Drawn by lab/plots_registry.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from servelab.lab.estimates import estimate
from servelab.lab.plots import legend_below, log_axis, pyplot, save
from servelab.lab.runs import Configuration

PROPOSER = "proposer"
PREFERRED_AXES = ("engine.max_num_seqs", "workload.rate")


def plot_speculation(configs: Sequence[Configuration], path: Path) -> bool:
    """Draws the plot at `path`; False unless the sweep has proposers beside `none`
    over a numeric axis."""
    found = speculation_curves(configs)
    if found is None:
        return False
    axis, curves = found
    plt = pyplot()
    fig, (ratio_ax, tpot_ax) = plt.subplots(1, 2, figsize=(13, 4.6))
    swept = sorted({x for points in curves.values() for x, _, _ in points})
    bases: dict[str, dict[float, Configuration]] = {}  # none's, by its other choices
    for points in curves.values():
        for x, _, base in points:
            rest = ", ".join(f"{k}={v}" for k, v in base.swept.items() if k != axis)
            bases.setdefault(rest, {})[x] = base
    for j, (label, line) in enumerate(bases.items()):
        xs = sorted(line)
        tpot = [estimate(line[x], "tpot_mean_ms").mean for x in xs]
        tpot_ax.plot(xs, tpot, ("-", "--", ":", "-.")[j % 4], color="black", marker="s", ms=4,
                     label=label)  # fmt: skip
    for i, (label, points) in enumerate(curves.items()):
        xs = [x for x, _, _ in points]
        ratios = [
            estimate(config, "output_tok_s").mean / estimate(base, "output_tok_s").mean
            for _, config, base in points
        ]
        lengths = [estimate(config, "spec_mean_accepted_length").mean for _, config, _ in points]
        style = dict(color=f"C{i % 10}", marker="o", ms=4)
        mean = sum(lengths) / len(lengths)
        ratio_ax.plot(xs, ratios, "-", label=f"{label} ({mean:.2f} tokens a verification)",
                      **style)  # fmt: skip
        for x, ratio in zip(xs, ratios):
            ratio_ax.annotate(f"{ratio:.2f}x", (x, ratio), textcoords="offset points",
                              xytext=(4, 4), fontsize=9, color=style["color"])  # fmt: skip
        tpot = [estimate(config, "tpot_mean_ms").mean for _, config, _ in points]
        tpot_ax.plot(xs, tpot, "-", **style)
    ratio_ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ratio_ax.set(ylabel="output tok/s over proposer=none's",
                 title="Speed-up of speculative decoding (dashed: break-even)")  # fmt: skip
    tpot_ax.set(ylabel="time per output token, mean (ms)",
                title="Time per output token (black: no speculation)")  # fmt: skip
    tpot_ax.set_ylim(bottom=0.0)
    for ax in (ratio_ax, tpot_ax):
        if min(swept) > 0:
            log_axis(ax, "x")
        ax.set_xticks(swept, [f"{x:g}" for x in swept])
        ax.set_xlabel(axis + (" (log)" if min(swept) > 0 else ""))
        ax.grid(True, alpha=0.3)
    clock = "virtual time" if all(c.deterministic for c in configs) else "means of repeats"
    fig.suptitle(f"Where speculative decoding stops paying ({clock})")
    fig.tight_layout()
    legend_below(fig, [ratio_ax], columns=3)
    save(fig, path)
    return True


def speculation_curves(
    configs: Sequence[Configuration],
) -> tuple[str, dict[str, list[tuple[float, Configuration, Configuration]]]] | None:
    """The numeric axis, and for each proposer but `none` (with the other choices
    in its label) its points (x, configuration, `none`'s at the same choices), in
    x order; None when the sweep has no such pairs."""
    swept = [c for c in configs if PROPOSER in c.swept and c.finished]
    axis = _numeric_axis(swept)
    if axis is None:
        return None
    baselines = {_others(c): c for c in swept if c.swept[PROPOSER] == "none"}
    curves: dict[str, list[tuple[float, Configuration, Configuration]]] = {}
    for config in swept:
        base = baselines.get(_others(config))
        if config.swept[PROPOSER] == "none" or base is None:
            continue
        rest = [f"{k}={v}" for k, v in config.swept.items() if k != axis]
        curves.setdefault(", ".join(rest), []).append((float(config.swept[axis]), config, base))
    return (axis, {k: sorted(v, key=lambda p: p[0]) for k, v in curves.items()}) if curves else None


def _numeric_axis(configs: Sequence[Configuration]) -> str | None:
    keys = [k for k in (configs[0].swept if configs else {}) if k != PROPOSER]
    numeric = [k for k in keys if all(_is_number(c.swept.get(k)) for c in configs)]
    for key in PREFERRED_AXES:
        if key in numeric:
            return key
    return numeric[0] if numeric else None


def _others(config: Configuration) -> tuple:
    """The configuration's choices but its proposer (the point it is compared at)."""
    return tuple(sorted((k, v) for k, v in config.swept.items() if k != PROPOSER))


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True
