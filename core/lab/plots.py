"""The report's per-configuration plots: throughput with its interval, latency
CDFs, KV use, batch size over time and a per-request timeline with its
preemptions. Legends sit outside the axes, so no legend covers data.
matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from servelab.lab.estimates import estimate, latency_samples
from servelab.lab.runs import Configuration, Run

TIMELINE_MAX_REQUESTS = 64  # "small workload": above this, one row per request is unreadable
MAX_PANELS = 6
LATENCIES = (("ttft", "time to first token"), ("tpot", "time per output token"),
             ("itl", "inter-token latency"), ("e2e", "end-to-end latency"))  # fmt: skip


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> None:
    fig.savefig(path, dpi=100, bbox_inches="tight")
    pyplot().close(fig)


def log_axis(ax, which: str = "x") -> None:
    """A log axis labelled in plain numbers at its major ticks, and at some minor
    ones only where the data spans under a decade (else they overlap, and a
    narrow axis would show no number at all)."""
    from matplotlib.ticker import LogFormatter, ScalarFormatter

    axis = ax.xaxis if which == "x" else ax.yaxis
    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.5)))


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


def plot_throughput(configs: Sequence[Configuration], path: Path) -> None:
    """Mean output tok/s per configuration with its 95% interval; dots: the repeats."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(configs) + 1.6))
    for row, config in enumerate(reversed(configs)):
        value = estimate(config, "output_tok_s")
        err = [[value.mean - value.low], [value.high - value.mean]] if value.n > 1 else None
        ax.barh(row, value.mean, color="tab:blue", alpha=0.7, xerr=err, capsize=4)
        ax.plot(config.values("output_tok_s"), [row] * len(config.finished), "k.", ms=4)
    ax.set_yticks(range(len(configs)), [c.label for c in reversed(configs)], fontsize=8)
    ax.set_xlabel("output tokens / s (bar: mean, whisker: 95% interval, dots: repeats)")
    ax.set_title("Output throughput per configuration")
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
    capacity, the y axis scaled to the run's peak (first repeat)."""
    shown = [c for c in configs if first_run(c) and first_run(c).steps()][: MAX_PANELS * 2]
    if not shown:
        return
    plt = pyplot()
    fig, axes = plt.subplots(len(shown), 1, figsize=(9, 1.2 + 1.7 * len(shown)), squeeze=False)
    for ax, config in zip(axes[:, 0], shown):
        steps = first_run(config).steps()
        x = x_values(steps, axis)
        capacity = max(max(s["kv_tokens_capacity"] for s in steps), 1)
        used = [100.0 * s["kv_tokens_used"] / capacity for s in steps]
        reserved = [100.0 * s["kv_tokens_reserved"] / capacity for s in steps]
        ax.plot(x, used, color="tab:blue", label="held by tokens")
        ax.plot(x, reserved, color="tab:orange", linestyle="--", label="reserved")
        peak = max(max(used), max(reserved), 1e-9)
        ax.set_ylim(0, peak * 1.15)
        ax.set_title(
            f"{config.label} — capacity {capacity:,} tokens, peak {peak:.3g}% reserved",
            fontsize=9,
        )
        ax.set_ylabel("% of capacity", fontsize=8)
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel(axis_label(axis))
    fig.suptitle("KV cache use (first repeat), each panel scaled to its peak")
    fig.tight_layout()
    legend_below(fig, axes[:, 0])
    save(fig, path)


def x_values(steps: Sequence[dict], axis: str) -> list[float]:
    if axis == "seconds":
        t0 = steps[0]["start_time"]
        return [s["start_time"] - t0 for s in steps]
    return [s["step"] for s in steps]


def axis_label(axis: str) -> str:
    return "seconds since the first step" if axis == "seconds" else "step"


def plot_batches(configs: Sequence[Configuration], path: Path, axis: str = "steps") -> None:
    """Sequences per step and tokens per step over time, one line per configuration."""
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for i, config in enumerate(configs[: MAX_PANELS * 2]):
        run = first_run(config)
        steps = run.steps() if run else []
        if not steps:
            continue
        x = x_values(steps, axis)
        top.plot(x, [s["num_seqs"] for s in steps], color=f"C{i % 10}", label=config.label)
        tokens = [s["prefill_tokens"] + s["decode_tokens"] for s in steps]
        bottom.plot(x, tokens, color=f"C{i % 10}", linewidth=0.8)
    top.set_ylabel("sequences in the step")
    bottom.set_ylabel("tokens in the step")
    bottom.set_xlabel(axis_label(axis))
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    fig.suptitle("Batch size and tokens per step (first repeat)")
    fig.tight_layout()
    legend_below(fig, [top], columns=2)
    save(fig, path)


def plot_timeline(configs: Sequence[Configuration], path: Path, axis: str = "steps") -> bool:
    """One panel per configuration (first repeat): a row per request, waiting
    (thin grey) then running (bar) until its last token, hatched while it holds
    a finished slot; each preemption a mark (swap: red v, recompute: black x)
    and a pale band until the request's next token."""
    small = [
        c for c in configs if first_run(c) and 0 < len(first_run(c).requests()) <= TIMELINE_MAX_REQUESTS
    ][:MAX_PANELS]  # fmt: skip
    if not small:
        return False
    plt = pyplot()
    # one x axis for every panel: how long each configuration took is part of the picture
    fig, axes = plt.subplots(
        len(small), 1, figsize=(10, 1.2 + 2.2 * len(small)), squeeze=False, sharex=True
    )
    for ax, config in zip(axes[:, 0], small):
        draw_requests(ax, first_run(config), axis)
        ax.set_title(config.label, fontsize=9)
    axes[-1, 0].set_xlabel(axis_label(axis))
    fig.suptitle("Requests over time: waiting, running, holding a finished slot, preemptions")
    fig.tight_layout()
    legend_below(fig, axes[:, 0], columns=5)
    save(fig, path)
    return True


def draw_requests(ax, run: Run, axis: str) -> None:
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
    labelled: set[str] = set()

    def once(name: str) -> str:
        shown = name not in labelled
        labelled.add(name)
        return name if shown else "_"

    for y, row in enumerate(rows):
        token_steps = json.loads(row.get("token_steps") or "[]")
        first = int(row["first_scheduled_step"])
        last = token_steps[-1] if token_steps else first
        release = max(int(row.get("finished_step") or last), last)
        arrived = (
            _arrival_step(row, steps, first_step) if axis == "steps" else row["arrival_time"] - t0
        )
        ax.hlines(y, arrived, at(first), color="0.7", linewidth=1, label=once("waiting"))
        ax.barh(y, at(last) - at(first) + (1 if axis == "steps" else 0), left=at(first),
                color="tab:blue", height=0.7, label=once("running"))  # fmt: skip
        if release > last:
            ax.barh(y, at(release) - at(last), left=at(last), color="white", edgecolor="tab:blue",
                    hatch="///", height=0.7, linewidth=0.4, label=once("finished, holding its slot"))  # fmt: skip
        for step, kind in json.loads(row.get("preemption_events") or "[]"):
            # out of the batch from its preemption until its next token
            resumed = next((t for t in token_steps if t > step), release)
            ax.barh(y, at(resumed) - at(step), left=at(step), color="mistyrose", height=0.7,
                    label=once("preempted, until its next token"))  # fmt: skip
            marker, color = ("v", "red") if kind == "swap" else ("x", "black")
            ax.plot(at(step), y, marker, color=color, ms=6, label=once(f"preempted: {kind}"))
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_ylabel("request (by arrival,\nthen admission)", fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)


def _arrival_step(row: dict, steps: Sequence[dict], first_step: int) -> float:
    """The first step that started at or after the request arrived."""
    for s in steps:
        if s["start_time"] >= row["arrival_time"]:
            return s["step"]
    return first_step
