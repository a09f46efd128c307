"""The report's per-configuration plots: throughput with its interval, latency
CDFs, KV use, batch size over time and a per-request timeline with its
preemptions. Legends sit outside the axes, so no legend covers data; panels
that compare share their axes; series that are identical are drawn once and
named together; fonts stay readable at a paper's column width. matplotlib is
imported only when a plot is drawn.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from servelab.lab.estimates import estimate, latency_samples
from servelab.lab.runs import Configuration, Run

TIMELINE_MAX_REQUESTS = 64  # "small workload": above this, one row per request is unreadable
MAX_PANELS = 6
LATENCIES = (("ttft", "time to first token"), ("tpot", "time per output token"),
             ("itl", "inter-token latency"), ("e2e", "end-to-end latency"))  # fmt: skip


# report.dpi (the format follows the file's suffix, report.format), and the note every
# plot's title carries for simulated runs (lab/simulated_label.py)
STYLE: dict = {"dpi": 150, "note": None}
FONTS = {"font.size": 11, "axes.titlesize": 11, "axes.labelsize": 11, "xtick.labelsize": 10,
         "ytick.labelsize": 10, "legend.fontsize": 10, "figure.titlesize": 13}  # fmt: skip


def configure(settings) -> None:
    STYLE["dpi"] = int(settings.get("dpi", STYLE["dpi"]))
    STYLE["note"] = settings.get("simulated")


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(FONTS)
    return plt


def save(fig, path: Path) -> None:
    if STYLE["note"]:
        stamp(fig, STYLE["note"])
    fig.savefig(path, dpi=STYLE["dpi"], bbox_inches="tight")
    pyplot().close(fig)


def stamp(fig, note: str) -> None:
    """`note` above everything the figure draws, its title included, in the
    figure's top line: a simulated result names itself before it is read."""
    box = fig.get_tightbbox(fig.canvas.get_renderer())
    top = box.y1 / fig.get_figheight()
    fig.text(0.5, top + 0.01, note, ha="center", va="bottom", fontsize="small",
             color="tab:purple", fontweight="bold")  # fmt: skip


HATCHES = ("", "//", "..", "xx", "\\\\", "oo")


def factor_styles(configs: Sequence[Configuration]) -> tuple[dict, list[tuple[str, dict]]]:
    """A colour per value of the first swept factor and a hatch per value of the
    second: {config label: style}, and the legend's (text, style) entries."""
    factors = list(configs[0].swept) if configs else []
    first = list(dict.fromkeys(c.swept.get(factors[0]) for c in configs)) if factors else []
    second = (list(dict.fromkeys(c.swept.get(factors[1]) for c in configs))
              if len(factors) > 1 else [])  # fmt: skip
    styles, legend = {}, []
    for config in configs:
        color = f"C{first.index(config.swept.get(factors[0])) % 10}" if factors else "C0"
        hatch = HATCHES[second.index(config.swept.get(factors[1])) % len(HATCHES)] if second else ""
        styles[config.label] = {"color": color, "hatch": hatch}
    legend += [(f"{factors[0]}={v}", {"color": f"C{i % 10}", "hatch": ""})
               for i, v in enumerate(first)]  # fmt: skip
    legend += [(f"{factors[1]}={v}", {"color": "white", "hatch": HATCHES[i % len(HATCHES)]})
               for i, v in enumerate(second)]  # fmt: skip
    return styles, legend


def factor_order(configs: Sequence[Configuration]) -> list[Configuration]:
    """Configurations grouped by their swept values, in the order each value first appears."""
    factors = list(configs[0].swept) if configs else []
    firsts = [list(dict.fromkeys(c.swept.get(f) for c in configs)) for f in factors]
    return sorted(configs, key=lambda c: [firsts[i].index(c.swept.get(f))
                                          for i, f in enumerate(factors)])  # fmt: skip


def log_axis(ax, which: str = "x") -> None:
    """A log axis labelled in plain numbers (`0.5`, `2`, `100`) at 3 to 8 ticks whatever
    its span: 1-2-5 steps, denser (1-2-3-5, then linear) on a narrow span, sparser (1-3,
    decades) on a wide one; the other log ticks unlabelled, for the grid."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis = ax.xaxis if which == "x" else ax.yaxis
    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    axis.set_major_locator(readable_log_locator())
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_locator(LogLocator(subs="auto"))
    axis.set_minor_formatter(NullFormatter())


LOG_STEPS = ((1.0,), (1.0, 3.0), (1.0, 2.0, 5.0), (1.0, 2.0, 3.0, 5.0),
             (1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.0))  # fmt: skip


def readable_log_ticks(low: float, high: float, least: int = 4, most: int = 8) -> list[float]:
    """Ticks in [low, high] for a log axis: the sparsest of LOG_STEPS that gives at least
    `least` (more than `most` decades: every k-th decade); linear steps where none does."""
    if not (0 < low < high and math.isfinite(high)):
        return []
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))

    def ticks(steps: tuple[float, ...]) -> list[float]:
        found = (float(f"{m * 10.0**e:.6g}") for e in range(first, last + 1) for m in steps)
        return [t for t in found if low <= t <= high]

    decades = ticks((1.0,))
    if len(decades) > most:
        stride = math.ceil(len(decades) / most)
        return decades[::stride]
    for steps in LOG_STEPS:
        found = ticks(steps)
        if len(found) >= least:
            return found if len(found) <= most else decades
    from matplotlib.ticker import MaxNLocator

    linear = MaxNLocator(nbins=5, steps=[1, 2, 2.5, 5, 10]).tick_values(low, high)
    return [float(f"{t:.6g}") for t in linear if low <= t <= high]


def readable_log_locator():
    """readable_log_ticks as a matplotlib locator of the axis's view limits (built here:
    matplotlib is imported only when a plot is drawn)."""
    from matplotlib.ticker import Locator

    class ReadableLogLocator(Locator):
        def __call__(self):
            return self.tick_values(*self.axis.get_view_interval())

        def tick_values(self, vmin, vmax):
            return readable_log_ticks(*sorted((vmin, vmax)))

    return ReadableLogLocator()


def legend_below(fig, axes, columns: int = 3) -> None:
    """One legend for the figure, under its axes."""
    seen: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    handles, labels = list(seen.values()), list(seen)
    if handles:
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0),
                   ncol=min(columns, len(labels)), fontsize="small", frameon=False)  # fmt: skip


def plot_throughput(configs: Sequence[Configuration], path: Path, claims=()) -> None:
    """Mean output tok/s per configuration with its 95% interval (never below
    zero) and n; dots: the repeats. Bars grouped by the swept factors: colour
    the first, hatch the second."""
    from matplotlib.patches import Patch

    plt = pyplot()
    ordered = factor_order(configs)
    styles, legend = factor_styles(ordered)
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(ordered) + 1.8))
    for row, config in enumerate(ordered):
        value = estimate(config, "output_tok_s")
        finite = value.n > 1 and math.isfinite(value.low) and math.isfinite(value.high)
        err = [[value.mean - value.low], [value.high - value.mean]] if finite else None
        style = styles[config.label]
        ax.barh(row, value.mean, color=style["color"], hatch=style["hatch"], alpha=0.75,
                edgecolor="black", linewidth=0.5, xerr=err, capsize=4)  # fmt: skip
        ax.plot(config.values("output_tok_s"), [row] * len(config.finished), "k.", ms=4)
        ax.annotate(f" n={value.n}", (max(value.high if finite else value.mean, value.mean), row),
                    va="center", fontsize=9)  # fmt: skip
    ax.set_yticks(range(len(ordered)), [c.label for c in ordered])
    ax.invert_yaxis()
    ax.set_xlim(left=0)
    ax.grid(True, axis="x", alpha=0.3)
    if all(c.deterministic for c in ordered):  # a virtual clock: one exact value, no interval
        ax.set_xlabel("output tokens / s of virtual time\n(bar: the exact value, dots: repeats)")
    else:
        ax.set_xlabel("output tokens / s\n(bar: mean, whisker: 95% interval, dots: repeats)")
    ax.set_title("Output throughput per configuration")
    if len(legend) > len(ordered) or len(list(configs[0].swept)) > 1:  # labels alone say one factor
        handles = [Patch(facecolor=st["color"], hatch=st["hatch"], edgecolor="black", label=text)
                   for text, st in legend]  # fmt: skip
        fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0),
                   ncol=min(4, len(handles)), frameon=False)  # fmt: skip
    fig.tight_layout()
    save(fig, path)


def plot_latency_cdfs(configs: Sequence[Configuration], path: Path) -> None:
    """CDFs of TTFT, TPOT, inter-token and end-to-end latency, repeats pooled."""
    import numpy as np

    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (kind, title) in zip(axes.flat, LATENCIES):
        for i, config in enumerate(configs):
            values = np.sort([v for run in config.finished for v in latency_samples(run, kind)])
            if values.size:
                frac = np.arange(1, values.size + 1) / values.size
                ax.step(values, frac, where="post", color=f"C{i % 10}", label=config.label)
        log_axis(ax, "x")
        ax.set_xlabel(f"{title} (ms, log)")
        ax.set_ylabel("fraction of " + ("tokens" if kind == "itl" else "requests"))
        ax.grid(True, alpha=0.3)
    fig.suptitle("Latency distributions (CDF, every repeat pooled)")
    fig.tight_layout()
    legend_below(fig, axes.flat, columns=2)
    save(fig, path)


def first_run(config: Configuration) -> Run | None:
    return config.finished[0] if config.finished else None


def plot_kv_use(configs: Sequence[Configuration], path: Path, axis: str = "steps") -> None:
    """One panel per configuration: KV tokens held and reserved, as % of the
    capacity (first repeat). Every panel shares the x and y axes, so a panel
    that uses twice the cache looks twice as full."""
    shown = [c for c in configs if first_run(c) and first_run(c).steps()][: MAX_PANELS * 2]
    if not shown:
        return
    plt = pyplot()
    fig, axes = plt.subplots(len(shown), 1, figsize=(9, 1.4 + 1.8 * len(shown)), squeeze=False,
                             sharex=True, sharey=True)  # fmt: skip
    top = 1e-9
    for ax, config in zip(axes[:, 0], shown):
        steps = first_run(config).steps()
        x = x_values(steps, axis)
        capacity = max(max(s["kv_tokens_capacity"] for s in steps), 1)
        used = [100.0 * s["kv_tokens_used"] / capacity for s in steps]
        reserved = [100.0 * s["kv_tokens_reserved"] / capacity for s in steps]
        ax.plot(x, used, color="tab:blue", label="held by tokens")
        ax.plot(x, reserved, color="tab:orange", linestyle="--", label="reserved")
        top = max(top, max(used), max(reserved))
        ax.set_title(f"{config.label} — peak {max(used):.3g}% held, {max(reserved):.3g}% "
                     f"reserved of {capacity:,} tokens", fontsize=10)  # fmt: skip
        ax.set_ylabel("% of capacity")
        ax.grid(True, alpha=0.3)
    axes[0, 0].set_ylim(0, top * 1.15)
    axes[-1, 0].set_xlabel(axis_label(axis))
    fig.suptitle("KV cache use (first repeat), every panel on the same axes")
    fig.tight_layout()
    legend_below(fig, axes[:, 0])
    save(fig, path)


def x_values(steps: Sequence[dict], axis: str) -> list[float]:
    if axis == "seconds":
        t0 = steps[0]["start_time"]
        return [s["start_time"] - t0 for s in steps]
    return [s["step"] for s in steps]


def axis_label(axis: str) -> str:
    if axis != "seconds":
        return "step"
    virtual = " (virtual time: simulated)" if STYLE["note"] else ""
    return f"seconds since the first step{virtual}"


def same_series(configs: Sequence[Configuration], series) -> list[tuple[str, object]]:
    """(label, series) with configurations whose `series(run)` are equal merged
    into one entry, labelled with each of their names joined by " = "."""
    merged: dict[str, tuple[list[str], object]] = {}
    for config in configs:
        run = first_run(config)
        values = series(run) if run else None
        if not values:
            continue
        key = json.dumps(values)
        merged.setdefault(key, ([], values))[0].append(config.label)
    return [(" = ".join(labels), values) for labels, values in merged.values()]


def plot_batches(configs: Sequence[Configuration], path: Path, axis: str = "steps") -> None:
    """Sequences per step and tokens per step over time, one line per
    configuration; configurations with identical series drawn once, named together."""

    def series(run):
        steps = run.steps()
        if not steps:
            return None
        return [x_values(steps, axis), [s["num_seqs"] for s in steps],
                [s["prefill_tokens"] + s["decode_tokens"] for s in steps]]  # fmt: skip

    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for i, (label, (x, seqs, tokens)) in enumerate(same_series(configs[: MAX_PANELS * 2], series)):
        top.plot(x, seqs, color=f"C{i % 10}", label=label)
        bottom.plot(x, tokens, color=f"C{i % 10}", linewidth=0.8)
    top.set_ylabel("sequences in the step")
    bottom.set_ylabel("tokens in the step")
    bottom.set_xlabel(axis_label(axis))
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    fig.suptitle("Batch size and tokens per step (first repeat; identical runs drawn once)")
    fig.tight_layout()
    legend_below(fig, [top], columns=1)
    save(fig, path)


def plot_timeline(configs: Sequence[Configuration], path: Path, axis: str = "steps") -> bool:
    """One panel per configuration (first repeat): a row per request, labelled
    with its id, waiting (thin grey) then running (bar) until its last token,
    hatched while it holds a finished slot; each preemption a mark (swap: red v,
    recompute: black x) and a pale band until the request's next token."""
    small = [
        c for c in configs if first_run(c) and 0 < len(first_run(c).requests()) <= TIMELINE_MAX_REQUESTS
    ][:MAX_PANELS]  # fmt: skip
    if not small:
        return False
    plt = pyplot()
    rows = max(len(first_run(c).requests()) for c in small)
    height = max(2.2, 0.05 * rows + 0.8)
    # one x axis for every panel: how long each configuration took is part of the picture
    fig, axes = plt.subplots(
        len(small), 1, figsize=(10, 1.2 + height * len(small)), squeeze=False, sharex=True
    )
    for ax, config in zip(axes[:, 0], small):
        draw_requests(ax, first_run(config), axis, max_labels=int(height * 72 / 11))
        ax.set_title(config.label, fontsize=11)
    axes[-1, 0].set_xlabel(axis_label(axis))
    if axis == "steps":  # a step is a whole number
        from matplotlib.ticker import MaxNLocator

        axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle("Requests over time: waiting, running, holding a finished slot, preemptions")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / fig.get_figheight()))  # room for the title
    legend_below(fig, axes[:, 0], columns=3)
    save(fig, path)
    return True


def draw_requests(ax, run: Run, axis: str, max_labels: int = 40) -> None:
    """Draws one run's requests, each kind of span in one call (a 64-request run
    has thousands of spans: one artist per span is what made this plot slow)."""
    steps = run.steps()
    start = {s["step"]: s["start_time"] for s in steps}
    t0 = steps[0]["start_time"] if steps else 0.0

    def at(step: int) -> float:
        return start.get(step, t0) - t0 if axis == "seconds" else step

    rows = sorted(
        (r for r in run.requests() if r.get("first_scheduled_step") is not None),
        key=lambda r: (r["arrival_time"], r["first_scheduled_step"]),
    )
    first_step = steps[0]["step"] if steps else 0
    waits, running, holding, preempted, marks = [], [], [], [], {"swap": [], "recompute": []}
    for y, row in enumerate(rows):
        token_steps = json.loads(row.get("token_steps") or "[]")
        first = int(row["first_scheduled_step"])
        last = token_steps[-1] if token_steps else first
        release = max(int(row.get("finished_step") or last), last)
        arrived = (
            _arrival_step(row, steps, first_step) if axis == "steps" else row["arrival_time"] - t0
        )
        waits.append((y, arrived, at(first)))
        running.append((y, at(first), at(last) - at(first) + (1 if axis == "steps" else 0)))
        if release > last:
            holding.append((y, at(last), at(release) - at(last)))
        for step, kind in json.loads(row.get("preemption_events") or "[]"):
            # out of the batch from its preemption until its next token
            resumed = next((t for t in token_steps if t > step), release)
            preempted.append((y, at(step), at(resumed) - at(step)))
            marks.setdefault(kind, []).append((at(step), y))
    if waits:
        ax.hlines([w[0] for w in waits], [w[1] for w in waits], [w[2] for w in waits],
                  color="0.6", linewidth=1, label="waiting")  # fmt: skip
    spans = ((running, {"color": "tab:blue"}, "running"),
             (holding, {"color": "white", "edgecolor": "tab:blue", "hatch": "///", "linewidth": 0.4},
              "finished, holding its slot"),
             (preempted, {"color": "mistyrose"}, "preempted, until its next token"))  # fmt: skip
    for spans_of_kind, style, label in spans:
        if spans_of_kind:
            ax.barh([y for y, _, _ in spans_of_kind], [w for _, _, w in spans_of_kind],
                    left=[x for _, x, _ in spans_of_kind], height=0.7, label=label, **style)  # fmt: skip
    for kind, points in marks.items():
        if points:
            marker, color = ("v", "red") if kind == "swap" else ("x", "black")
            ax.plot([x for x, _ in points], [y for _, y in points], marker, color=color, ms=6,
                    linestyle="none", label=f"preempted: {kind}")  # fmt: skip
    every = max(1, math.ceil(len(rows) / max(1, max_labels)))
    ticks = list(range(0, len(rows), every))
    ax.set_yticks(ticks, [str(rows[i]["request_id"]) for i in ticks], fontsize=9)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_ylabel("request id\n(by arrival)")
    ax.grid(True, axis="x", alpha=0.3)


def _arrival_step(row: dict, steps: Sequence[dict], first_step: int) -> float:
    """The first step that started at or after the request arrived."""
    for s in steps:
        if s["start_time"] >= row["arrival_time"]:
            return s["step"]
    return first_step
