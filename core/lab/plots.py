"""The report's PNG plots: throughput per configuration, TTFT and inter-token
latency CDFs, KV held and reserved over time, and for small workloads a slot
timeline (one row per batch slot, one bar per request; a static batch's idle
tail is hatched). matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from servelab.lab.runs import Run, figure, fmt

TIMELINE_MAX_REQUESTS = 64  # "small workload": above this, a slot timeline is unreadable
TIMELINE_MAX_RUNS = 6


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(runs: Sequence[Run], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(runs) + 1.5))
    labels = [run.label for run in runs][::-1]
    values = [figure(run, "output_tok_s") for run in runs][::-1]
    bars = ax.barh(labels, values, color="tab:blue")
    ax.bar_label(bars, fmt="%.1f", padding=3)
    ax.set_xlabel("output tokens / s")
    ax.set_title("Output throughput per configuration")
    ax.margins(x=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def request_latencies(run: Run, kind: str) -> list[float]:
    """TTFT per request or every inter-token latency, in ms."""
    out = []
    for row in run.requests():
        if row.get("finish_reason") not in ("stop", "length"):
            continue
        if kind == "ttft":
            if row.get("ttft") is not None:
                out.append(1000.0 * float(row["ttft"]))
        else:
            times = json.loads(row.get("token_times") or "[]")
            out += [1000.0 * (b - a) for a, b in zip(times, times[1:])]
    return out


def plot_cdf(runs: Sequence[Run], kind: str, path: Path) -> None:
    import numpy as np

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        values = np.sort(request_latencies(run, kind))
        if values.size:
            ax.step(
                values, np.arange(1, values.size + 1) / values.size, where="post", label=run.label
            )
    ax.set_xscale("log")
    ax.set_xlabel(f"{'time to first token' if kind == 'ttft' else 'inter-token latency'} (ms, log)")
    ax.set_ylabel("fraction of " + ("requests" if kind == "ttft" else "tokens"))
    ax.set_title(f"{kind.upper()} distribution (CDF)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_kv_util(runs: Sequence[Run], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, run in enumerate(runs):
        steps = run.steps()
        if not steps:
            continue
        t0 = steps[0]["start_time"]
        times = [s["start_time"] - t0 for s in steps]
        color = f"C{i % 10}"
        used = [100.0 * s["kv_tokens_used"] / max(s["kv_tokens_capacity"], 1) for s in steps]
        reserved = [
            100.0 * s["kv_tokens_reserved"] / max(s["kv_tokens_capacity"], 1) for s in steps
        ]
        ax.plot(times, used, color=color, label=f"{run.label}: used")
        ax.plot(
            times, reserved, color=color, linestyle="--", alpha=0.6, label=f"{run.label}: reserved"
        )
    ax.set_xlabel("time since first step (s)")
    ax.set_ylabel("% of KV capacity")
    ax.set_ylim(bottom=0)  # no fixed top: a large cache is often only a few % full
    ax.set_title("KV cache: tokens held (solid) and reserved (dashed)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def assign_slots(intervals: Sequence[tuple[int, int]]) -> list[int]:
    """Greedy interval colouring: each (first step, last step) interval, in
    start order, takes the lowest slot free since before its first step."""
    order = sorted(range(len(intervals)), key=lambda i: intervals[i])
    free_from: list[int] = []  # per slot: first step it is free again
    slots = [0] * len(intervals)
    for i in order:
        start, end = intervals[i]
        slot = next((s for s, f in enumerate(free_from) if f <= start), len(free_from))
        if slot == len(free_from):
            free_from.append(0)
        free_from[slot] = end + 1
        slots[i] = slot
    return slots


def plot_timeline(runs: Sequence[Run], path: Path) -> bool:
    """One panel per run: slots on y, steps on x; a bar per request from its
    first scheduled step to its last token, hatched on to its release."""
    small = [r for r in runs if 0 < len(r.requests()) <= TIMELINE_MAX_REQUESTS][:TIMELINE_MAX_RUNS]
    if not small:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(
        len(small), 1, figsize=(10, 1.0 + 1.6 * len(small)), squeeze=False, sharex=True
    )
    for ax, run in zip(axes[:, 0], small):
        rows = [r for r in run.requests() if r.get("first_scheduled_step") is not None]
        spans = []
        for row in rows:
            token_steps = json.loads(row.get("token_steps") or "[]")
            first = int(row["first_scheduled_step"])
            last = token_steps[-1] if token_steps else first
            release = int(row["finished_step"]) if row.get("finished_step") is not None else last
            spans.append((first, last, max(release, last)))
        slots = assign_slots([(a, c) for a, _, c in spans])
        for i, ((first, last, release), slot) in enumerate(zip(spans, slots)):
            color = f"C{i % 10}"
            ax.barh(
                slot, last - first + 1, left=first, color=color, edgecolor="black", linewidth=0.4
            )
            if release > last:
                ax.barh(
                    slot,
                    release - last,
                    left=last + 1,
                    color="white",
                    edgecolor=color,
                    hatch="///",
                    linewidth=0.4,
                )
            ax.text(first + 0.5, slot, str(rows[i]["request_id"])[-8:], va="center", fontsize=6)
        ax.set_yticks(range(max(slots) + 1 if slots else 1))
        ax.set_yticklabels([f"slot {s}" for s in range(max(slots) + 1 if slots else 1)], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(
            f"{run.label} — idle slot-steps {fmt(figure(run, 'idle_slot_pct'))}%", fontsize=9
        )
    axes[-1, 0].set_xlabel("step")
    fig.suptitle("Batch slots over time (hatched: finished but holding its slot)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
