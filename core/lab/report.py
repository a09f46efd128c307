"""`servelab-report PATH...`: run folders -> one table and a few plots.

A PATH is a run folder (it holds `results.json`) or any folder above run
folders (a multirun). Writes into `--out` (default: the only PATH, else
`./servelab-report`):
- `summary.csv`: one row per run, best first: the swept choices, then every figure;
- `summary.md`: the preset's claims, evaluated, then the key figures per run;
- `throughput.png`, `ttft_cdf.png`, `itl_cdf.png`, `kv_util.png` and, for small
  workloads, `timeline.png` (drawn by `servelab.lab.plots`).
Runs are read by `servelab.lab.runs`, claims evaluated by `servelab.lab.claims`.
"""

from __future__ import annotations

import argparse
import csv
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from servelab.errors import ConfigError
from servelab.lab.claims import CLAIM_OPS, ClaimResult, evaluate_claim, evaluate_claims
from servelab.lab.plots import (
    assign_slots,
    plot_cdf,
    plot_kv_util,
    plot_throughput,
    plot_timeline,
)
from servelab.lab.runs import Run, figure, fmt, load_runs, mark_swept
from servelab.registry.typed import check_value

__all__ = [  # callers import every report name from here, wherever it is defined
    "CLAIM_OPS",
    "HIGHER_IS_BETTER",
    "KEY_FIGURES",
    "REPORT_DEFAULTS",
    "ClaimResult",
    "Run",
    "assign_slots",
    "evaluate_claim",
    "evaluate_claims",
    "figure",
    "fmt",
    "load_runs",
    "main",
    "mark_swept",
    "markdown",
    "report_options",
    "sort_runs",
    "summary_rows",
    "write_report",
]

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
        row["status"] = "error" if run.error else "ok"  # after the figures: swept keys come first
        if run.error:
            row["error"] = run.error
        rows.append(row)
    return rows


# -- the report


REPORT_DEFAULTS = {"title": None, "sort": "output_tok_s", "figures": [], "claims": []}
REPORT_TYPES = {"title": str | None, "sort": str, "figures": list, "claims": list}


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
    for key in ("title", "sort"):
        check_value(f"report option {key}", options[key], REPORT_TYPES[key])
    for key in ("figures", "claims"):
        if not isinstance(options[key], (list, tuple)):
            raise ConfigError(f"report option {key} must be a list, got {options[key]!r}")
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

    finished = [run for run in runs if not run.error]  # a failed job has no records to plot
    plots = {
        "throughput.png": lambda p: plot_throughput(finished, p),
        "ttft_cdf.png": lambda p: plot_cdf(finished, "ttft", p),
        "itl_cdf.png": lambda p: plot_cdf(finished, "itl", p),
        "kv_util.png": lambda p: plot_kv_util(finished, p),
        "timeline.png": lambda p: plot_timeline(finished, p),
    }
    written = [name for name, draw in plots.items() if finished and draw(out / name) is not False]
    claims = evaluate_claims(finished, settings["claims"])
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
        if run.error:
            cells += ["failed"] + [""] * (len(figures) - 1)
        else:
            cells += [fmt(run.summary.get(name)) for name in figures]
        lines.append("| " + " | ".join(cells) + " |")
    failed = [run for run in runs if run.error]
    if failed:
        lines += ["", f"## Failed runs ({len(failed)})", ""]
        lines += [f"- {run.label} (`{run.folder}`): {run.error}" for run in failed]
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
