"""`servelab-report PATH...`: run folders -> one table and a few plots.

A PATH is a run folder (it holds `results.json`) or any folder above run
folders (a multirun). Writes into `--out` (default: the only PATH, else
`./servelab-report`):
- `summary.csv`: one row per run, best first: the swept choices, then every figure;
- `summary.md`: the preset's claims, evaluated, then the key figures per run;
- `throughput.png`, `ttft_cdf.png`, `itl_cdf.png`, `kv_util.png`, and for small
  workloads `timeline.png` (one row per batch slot, one bar per request, like
  the seeds' diagram; a static batch's idle tail is hatched).

Swept choices are the `key=value` overrides and config-group choices whose
values differ between the runs; the rest are listed once, as fixed.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servelab.errors import ConfigError

KEY_FIGURES = (
    "output_tok_s",
    "request_throughput",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "e2e_p50_ms",
    "kv_util_pct",
    "reservation_waste_pct",
    "padding_waste_pct",
    "idle_slot_pct",
    "preemptions",
    "prefix_hit_rate",
    "longest_stall_ms",
)
HIGHER_IS_BETTER = frozenset(
    {
        "output_tok_s",
        "total_tok_s",
        "request_throughput",
        "kv_util_pct",
        "peak_kv_util_pct",
        "prefix_hit_rate",
        "prefix_hit_tokens",
        "peak_seqs",
        "mean_seqs",
        "finished_pct",
        "requests",
    }
)
CLAIM_OPS = {
    "ratio_at_least": (True, lambda r, x: r >= x, "≥ {x:g}×"),
    "ratio_at_most": (True, lambda r, x: r <= x, "≤ {x:g}×"),
    "ratio_below": (True, lambda r, x: r < x, "< {x:g}×"),
    "at_least": (False, lambda v, x: v >= x, "≥ {x:g}"),
    "at_most": (False, lambda v, x: v <= x, "≤ {x:g}"),
}
TIMELINE_MAX_REQUESTS = 64  # "small workload": above this, a slot timeline is unreadable
TIMELINE_MAX_RUNS = 6
IGNORED_PARAMS = ("experiment",)  # the preset itself is the same in every run of it


# -- loading


@dataclass
class Run:
    folder: Path
    results: dict
    params: dict[str, str]  # key=value overrides, then group choices (see run_params)
    swept: dict[str, str] = field(default_factory=dict)

    @property
    def summary(self) -> dict[str, Any]:
        return self.results.get("summary", {})

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.swept.items()) or self.folder.name

    def requests(self) -> list[dict]:
        return read_csv(self.folder / "requests.csv")

    def steps(self) -> list[dict]:
        return read_csv(self.folder / "steps.csv")


def find_run_folders(paths: Iterable[str | Path]) -> list[Path]:
    folders: list[Path] = []
    for path in map(Path, paths):
        if not path.exists():
            raise ConfigError(f"no such file or folder: {str(path)!r}")
        found = [path] if (path / "results.json").is_file() else []
        found += sorted(p.parent for p in path.rglob("results.json") if p.parent != path)
        if not found:
            raise ConfigError(f"{str(path)!r} holds no run (no results.json below it)")
        folders += [f for f in found if f not in folders]
    return folders


def normalize(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    text = str(value)
    return text.lower() if text.lower() in ("true", "false", "null", "none") else text


def run_params(results: Mapping) -> dict[str, str]:
    """The run's `key=value` overrides (in their order), then its group choices."""
    params = {}
    for override in results.get("overrides") or []:
        key, sep, value = str(override).lstrip("+~").partition("=")
        if sep:
            params[key] = normalize(value)
    for key, value in (results.get("choices") or {}).items():
        params.setdefault(key, normalize(value))
    return {k: v for k, v in params.items() if k not in IGNORED_PARAMS}


def load_runs(paths: Iterable[str | Path]) -> list[Run]:
    runs = []
    for folder in find_run_folders(paths):
        results = json.loads((folder / "results.json").read_text())
        runs.append(Run(folder, results, run_params(results)))
    mark_swept(runs)
    return runs


def mark_swept(runs: Sequence[Run]) -> dict[str, str]:
    """Sets each run's `swept` (params whose values differ between runs);
    returns the params every run shares."""
    keys: list[str] = []
    for run in runs:
        keys += [k for k in run.params if k not in keys]
    varying = [k for k in keys if len({run.params.get(k, "") for run in runs}) > 1]
    if len(runs) == 1:  # one run: what the user chose is what it shows
        overrides = run_params({"overrides": runs[0].results.get("overrides")})
        varying = [k for k in overrides if k not in IGNORED_PARAMS]
    for run in runs:
        run.swept = {k: run.params.get(k, "") for k in varying}
    return {k: runs[0].params[k] for k in keys if k not in varying and k in runs[0].params}


def read_csv(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with path.open(newline="") as handle:
        return [{k: parse_cell(v) for k, v in row.items()} for row in csv.DictReader(handle)]


def parse_cell(text: str) -> Any:
    if text == "":
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


# -- the table


def figure(run: Run, name: str) -> float:
    value = run.summary.get(name)
    return float(value) if isinstance(value, (int, float)) else math.nan


def sort_runs(runs: Sequence[Run], by: str) -> list[Run]:
    """Best first by `by`; a run without the figure goes last."""
    sign = -1.0 if by in HIGHER_IS_BETTER else 1.0

    def key(run: Run) -> tuple[bool, float]:
        value = figure(run, by)
        return (math.isnan(value), sign * value if not math.isnan(value) else 0.0)

    return sorted(runs, key=key)


def summary_rows(runs: Sequence[Run]) -> list[dict]:
    swept = list(runs[0].swept) if runs else []
    rows = []
    for run in runs:
        row = {"run": str(run.folder), **{k: run.swept.get(k, "") for k in swept}}
        row.update(run.summary)
        rows.append(row)
    return rows


def fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


# -- claims


@dataclass
class ClaimResult:
    text: str
    holds: bool | None  # None: the runs it names are missing


def evaluate_claims(runs: Sequence[Run], claims: Iterable[Mapping]) -> list[ClaimResult]:
    return [result for claim in claims for result in evaluate_claim(runs, claim)]


def parse_selector(selector: str) -> dict[str, str]:
    """`"scheduler=static attention=padded"` -> {scheduler: static, attention: padded}."""
    pairs = {}
    for part in str(selector).split():
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ConfigError(f"report claim: a run is selected by key=value, got {selector!r}")
        pairs[key] = normalize(value)
    if not pairs:
        raise ConfigError("report claim: an empty run selector")
    return pairs


def matches(run: Run, selector: dict[str, str]) -> bool:
    return all(run.params.get(k) == v for k, v in selector.items())


def evaluate_claim(runs: Sequence[Run], claim: Mapping) -> list[ClaimResult]:
    """A claim names a figure, the runs it is about (`run`: space-separated
    `key=value`s), optionally the runs to compare with (`vs`), and one of
    CLAIM_OPS; or a figure and `same_in_every_run: true`. Where several runs
    match (a sweep over more keys), each is paired with the `vs` run that has
    the same values of the other swept keys, and each pair is stated."""
    claim = dict(claim)
    name, text = claim.pop("figure", None), claim.pop("text", None)
    if claim.pop("same_in_every_run", False):
        values = {str(run.summary.get(name)) for run in runs}
        shown = ", ".join(sorted(values))
        return [
            ClaimResult(
                f"{text or name + ' is the same in every run'} — {name}: {shown}",
                len(values) == 1 and "None" not in values,
            )
        ]
    run_sel, vs_sel = claim.pop("run", None), claim.pop("vs", None)
    ops = [op for op in claim if op in CLAIM_OPS]
    unknown = [k for k in claim if k not in CLAIM_OPS]
    if not name or not run_sel or len(ops) != 1 or unknown:
        raise ConfigError(
            f"report claim {claim!r}: needs figure, run (key=value), optional vs and text, "
            f"and exactly one of {', '.join(CLAIM_OPS)} (or figure + same_in_every_run: true)"
        )
    op = ops[0]
    is_ratio, test, shown = CLAIM_OPS[op]
    if is_ratio and not vs_sel:
        raise ConfigError(f"report claim on {name}: {op} compares two runs; give `vs`")
    bound = float(claim[op])
    run_pairs = parse_selector(run_sel)
    picked = [r for r in runs if matches(r, run_pairs)]
    heading = text or f"{name} of {run_sel}"
    if not picked:
        return [ClaimResult(f"{heading} — no run with {run_sel}", None)]
    results = []
    for run in picked:
        value = figure(run, name)
        if not is_ratio:
            holds = test(value, bound) if not math.isnan(value) else False
            detail = f"{name} = {fmt(value)} ({run.label}) [claim {shown.format(x=bound)}]"
            results.append(ClaimResult(f"{heading} — {detail}", holds))
            continue
        vs_pairs = parse_selector(vs_sel)
        # pair with the run that differs only in what the two selectors name
        others = {k: v for k, v in run.swept.items() if k not in run_pairs and k not in vs_pairs}
        partners = [
            r
            for r in runs
            if matches(r, vs_pairs) and all(r.swept.get(k) == v for k, v in others.items())
        ]
        if not partners:
            results.append(ClaimResult(f"{heading} — no run with {vs_sel} to compare", None))
            continue
        base = figure(partners[0], name)
        ratio = value / base if base else math.inf if value > 0 else math.nan
        holds = test(ratio, bound) if not math.isnan(ratio) else False
        where = f" at {', '.join(f'{k}={v}' for k, v in others.items())}" if others else ""
        detail = (
            f"{name}: {fmt(value)} ({run_sel}) vs {fmt(base)} ({vs_sel}){where} = "
            f"{fmt(ratio)}× [claim {shown.format(x=bound)}]"
        )
        results.append(ClaimResult(f"{heading} — {detail}", holds))
    return results


# -- plots


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


# -- the report


REPORT_DEFAULTS = {"title": None, "sort": "output_tok_s", "figures": [], "claims": []}


def report_options(node: Mapping | None) -> dict:
    """The config's `report:` node with defaults; an unknown key is a ConfigError."""
    options = {k: (list(v) if isinstance(v, list) else v) for k, v in REPORT_DEFAULTS.items()}
    for key, value in (node or {}).items():
        if key not in REPORT_DEFAULTS:
            raise ConfigError(
                f"unknown report option {key!r}; accepted: {', '.join(REPORT_DEFAULTS)}"
            )
        if value is not None:
            options[key] = value
    options["title"] = options["title"] or "servelab sweep"
    options["figures"], options["claims"] = list(options["figures"]), list(options["claims"])
    return options


def report_settings(runs: Sequence[Run]) -> dict:
    return report_options((runs[0].results.get("config") or {}).get("report"))


def write_report(paths: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Loads the runs under `paths` and writes the table, the claims and the plots."""
    runs = load_runs(paths)
    fixed = mark_swept(runs)
    settings = report_settings(runs)
    runs = sort_runs(runs, settings["sort"])
    out = Path(out) if out else (Path(paths[0]) if len(paths) == 1 else Path("servelab-report"))
    out.mkdir(parents=True, exist_ok=True)

    rows = summary_rows(runs)
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    with (out / "summary.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)

    plots = {
        "throughput.png": lambda p: plot_throughput(runs, p),
        "ttft_cdf.png": lambda p: plot_cdf(runs, "ttft", p),
        "itl_cdf.png": lambda p: plot_cdf(runs, "itl", p),
        "kv_util.png": lambda p: plot_kv_util(runs, p),
        "timeline.png": lambda p: plot_timeline(runs, p),
    }
    written = [name for name, draw in plots.items() if draw(out / name) is not False]
    claims = evaluate_claims(runs, settings["claims"])
    figures = list(dict.fromkeys([settings["sort"], *KEY_FIGURES, *settings["figures"]]))
    (out / "summary.md").write_text(markdown(settings, runs, fixed, claims, figures, written))
    return out


def markdown(settings, runs, fixed, claims, figures, plots) -> str:
    lines = [f"# {settings['title']}", ""]
    if claims:
        lines += ["## Claims", ""]
        for claim in claims:
            mark = {True: "✅ holds", False: "❌ does not hold", None: "⚠️ cannot check"}[
                claim.holds
            ]
            lines.append(f"- {mark}: {claim.text}")
        lines.append("")
    lines += [f"## Runs ({len(runs)}), best {settings['sort']} first", ""]
    if fixed:
        lines += ["Same in every run: " + ", ".join(f"`{k}={v}`" for k, v in fixed.items()), ""]
    swept = list(runs[0].swept) if runs else []
    header = ["#", *swept, *figures]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join("---" for _ in header) + "|")
    for i, run in enumerate(runs, start=1):
        cells = [str(i), *(run.swept.get(k, "") for k in swept)]
        cells += [fmt(run.summary.get(name)) for name in figures]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Run folders: " + ", ".join(f"`{run.folder}`" for run in runs), ""]
    lines += ["## Plots", ""] + [f"![{name[:-4]}]({name})" for name in plots] + [""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        prog="servelab-report",
        description="Turn servelab run folders (or a multirun folder) into summary.csv, "
        "summary.md and plots.",
    )
    parser.add_argument("paths", nargs="+", help="run folders or folders above them")
    parser.add_argument("--out", help="where to write (default: the only PATH)")
    args = parser.parse_args(argv)
    out = write_report(args.paths, args.out)
    print(f"servelab-report: wrote {out / 'summary.md'}, {out / 'summary.csv'} and plots in {out}")
    print((out / "summary.md").read_text())
    return out
