"""`workload.png`: the shape of what a report's runs replayed, so a reader sees
the workload behind the figures: the prompt-length and output-length
histograms and the arrival rate over time (requests per second in 40 equal
bins from the first arrival; a workload whose requests all arrive at once is
said so in words, since a rate over no time means nothing). Read from each run's requests.csv (the lengths
as served: a capped prompt shows capped). Runs that replayed the same workload
(equal `workload` config nodes) are drawn once; distinct ones (a rate sweep, two
traces) are overlaid, at most `MAX_WORKLOADS`, their lengths drawn once when equal. A public trace's file, hash and
capped counts (the run's provenance, servelab.lab.public_traces) go in the title.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from servelab.lab.plots import pyplot, save
from servelab.lab.runs import Run

MAX_WORKLOADS = 8
RATE_BINS = 40


def plot_workloads(runs: Sequence[Run], path: Path) -> bool:
    """Draws the workload plot at `path`; False when no run finished (nothing drawn)."""
    shapes = distinct_workloads(runs)
    if not shapes:
        return False
    plt = pyplot()
    fig, (prompts, outputs, rate) = plt.subplots(1, 3, figsize=(15, 4.2))
    drawn: set[tuple] = set()  # a rate sweep replays the same lengths: one histogram of them
    at_once = 0  # workloads whose requests all arrive at one instant (an offline batch)
    for index, (label, rows) in enumerate(shapes):
        prompt = np.array([float(r["prompt_tokens"]) for r in rows])
        output = np.array([float(r["output_tokens"]) for r in rows])
        arrival = np.array([float(r["arrival_time"]) for r in rows])
        lengths = (tuple(np.sort(prompt)), tuple(np.sort(output)))
        if lengths not in drawn:
            drawn.add(lengths)
            color = f"C{index}"
            prompts.hist(prompt, bins=40, histtype="step", linewidth=1.5, color=color)
            outputs.hist(output, bins=40, histtype="step", linewidth=1.5, color=color)
        if np.ptp(arrival) <= 0:
            at_once += 1
            continue
        times, per_second = arrival_rate(arrival)
        rate.step(times, per_second, where="post", linewidth=1.2, label=label, color=f"C{index}")
    prompts.set(xlabel="prompt tokens", ylabel="requests", title="Prompt lengths")
    outputs.set(xlabel="output tokens", ylabel="requests", title="Output lengths")
    rate.set(xlabel="seconds after the first arrival", ylabel="requests / s",
             title="Arrival rate")  # fmt: skip
    if at_once == len(shapes):  # a rate over a zero-length span means nothing: say what happened
        rate.set(xticks=[], yticks=[], xlabel="", ylabel="")
        rate.text(0.5, 0.5, f"all {len(shapes[0][1])} requests arrive at once\n(an offline batch)",
                  ha="center", va="center", transform=rate.transAxes)  # fmt: skip
    elif len(shapes) > 1:
        rate.legend(fontsize="small", frameon=False)
    fig.suptitle(title(runs[0], shapes), fontsize="medium")
    fig.tight_layout()
    save(fig, path)
    return True


def distinct_workloads(runs: Sequence[Run]) -> list[tuple[str, list[dict]]]:
    """(label, requests.csv rows) of each distinct workload node, first run of each."""
    seen: dict[str, Run] = {}
    for run in runs:
        if run.error or not (run.folder / "requests.csv").is_file():
            continue
        node = (run.results.get("config") or {}).get("workload")
        seen.setdefault(json.dumps(node, sort_keys=True, default=str), run)
    shapes = []
    for run in list(seen.values())[:MAX_WORKLOADS]:
        rows = run.requests()
        if rows:
            swept = {k: v for k, v in run.swept.items() if k.startswith("workload")}
            label = ", ".join(f"{k}={v}" for k, v in swept.items()) or workload_name(run)
            shapes.append((label, rows))
    return shapes


def arrival_rate(arrival: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bin edges (seconds from the first arrival) and requests per second in each bin."""
    offsets = arrival - arrival.min()
    span = float(offsets.max())  # > 0: plot_workloads words a zero span instead
    counts, edges = np.histogram(offsets, bins=RATE_BINS, range=(0.0, span))
    per_second = counts / (span / RATE_BINS)
    return edges, np.append(per_second, per_second[-1])  # `step` draws the last bin too


def workload_name(run: Run) -> str:
    node = (run.results.get("config") or {}).get("workload") or {}
    return str(node.get("name", "workload")) if isinstance(node, dict) else str(node)


def title(run: Run, shapes: Sequence[tuple[str, list[dict]]]) -> str:
    """The workload's name and size; for a public trace its file, hash and caps."""
    count = len(shapes[0][1])
    trace = run.provenance.get("workload_trace")
    if not trace:
        return f"Workload: {workload_name(run)}, {count} requests"
    capped = [f"{trace.get(k, 0)} {k.replace('_', ' ')}" for k in ("capped_input", "capped_output")]
    return (
        f"Workload: {trace.get('trace')} trace {trace.get('file')} "
        f"(sha256 {str(trace.get('sha256'))[:12]}), {count} requests; {', '.join(capped)}"
    )
