"""`servelab-report PATH... [report.KEY=VALUE...]`: run folders -> tables with
intervals, decided claims and plots; the report options are the stored runs',
overridden by any given (lab/report_overrides.py).

A PATH is a run folder (it holds `results.json`) or any folder above run
folders (a multirun). Runs with the same swept choices are repeats of one
configuration (lab/runs.py); each figure is an estimate over them with a 95%
interval (lab/estimates.py, lab/stats.py). Writes into `--out` (default: the
only PATH, else `./servelab-report`):
- `summary.csv`: one row per configuration, best first: swept choices, then per
  figure its mean, std and interval; `runs.csv`: one row per run;
- `summary.md`: provenance warnings (mixed versions, busy machine), the claims
  and their verdicts with their n, capacity under the SLO, the key figures per
  configuration, failed runs, the plots;
- the plots of lab/plots_registry.py (`report.plots`, `report.format`, `report.dpi`).
"""

from __future__ import annotations

import argparse
import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from servelab.errors import ConfigError
from servelab.lab.claims import CLAIM_OPS, ClaimResult, evaluate_claim, evaluate_claims
from servelab.lab.estimates import estimate
from servelab.lab.plots_registry import draw_plots, plot_names, wanted_plots
from servelab.lab.progress import Progress
from servelab.lab.provenance import busy_warnings, mixed_provenance
from servelab.lab.report_markdown import markdown
from servelab.lab.report_overrides import apply_overrides, is_override
from servelab.lab.runs import Configuration, Run, figure, fmt, group_runs, load_runs, mark_swept
from servelab.lab.simulated_label import report_note, run_label
from servelab.lab.slo import SLO_DEFAULTS, add_slo_figures, capacity, slo_options
from servelab.lab.stats import MIN_REPEATS, mean_estimate
from servelab.registry.typed import check_value

__all__ = [  # callers import every report name from here, wherever it is defined
    "CLAIM_OPS",
    "HIGHER_IS_BETTER",
    "KEY_FIGURES",
    "REPORT_DEFAULTS",
    "ClaimResult",
    "Run",
    "evaluate_claim",
    "evaluate_claims",
    "figure",
    "fmt",
    "group_runs",
    "load_runs",
    "main",
    "mark_swept",
    "markdown",
    "report",
    "report_options",
    "sort_configs",
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
# shown too whenever a run has them: how a cluster's router spread the requests
CLUSTER_FIGURES = (
    "load_imbalance",
    "requests_per_replica",
    "sent_to_busy_while_idle",
    "decode_load_imbalance",
    "requests_per_decode_replica",
)
# shown too whenever a run has them: speculative decoding's (docs/speculative.md)
SPECULATION_FIGURES = ("spec_acceptance_pct", "spec_mean_accepted_length")
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
        "goodput_rps",
        "slo_attainment_pct",
        "spec_acceptance_pct",
        "spec_mean_accepted_length",
    }
)


def sort_configs(configs: Sequence[Configuration], by: str) -> list[Configuration]:
    """Best mean `by` first; a configuration without the figure goes last."""
    sign = -1.0 if by in HIGHER_IS_BETTER else 1.0

    def key(config: Configuration) -> tuple[bool, float]:
        value = mean_estimate(config.values(by)).mean
        return (math.isnan(value), sign * value if not math.isnan(value) else 0.0)

    return sorted(configs, key=key)


def summary_rows(configs: Sequence[Configuration], figures: Sequence[str]) -> list[dict]:
    """One row per configuration: its swept choices, runs, status, then per
    figure its mean, standard deviation and 95% interval."""
    swept = list(configs[0].swept) if configs else []
    rows = []
    for config in configs:
        row: dict = {k: config.swept.get(k, "") for k in swept}
        row["runs"] = len(config.finished)
        for name in figures:
            value = estimate(config, name)
            row.update(
                {name: value.mean, f"{name}_std": value.std, f"{name}_ci_low": value.low,
                 f"{name}_ci_high": value.high, f"{name}_exact": value.exact}
            )  # fmt: skip
        for name in _text_keys(config.finished):  # e.g. output_digest: one value, or each
            row[name] = "|".join(dict.fromkeys(str(r.summary.get(name)) for r in config.finished))
        row["status"] = "error" if config.error else "ok"  # after the figures: choices first
        if config.error:
            row["error"] = config.error
        rows.append(row)
    return rows


def run_rows(runs: Sequence[Run]) -> list[dict]:
    """One row per run (repeats apart), with every figure of its summary."""
    swept = list(runs[0].swept) if runs else []
    rows = []
    for run in runs:
        row = {"run": str(run.folder), **{k: run.swept.get(k, "") for k in swept}}
        row["repeat"] = run.repeat
        row.update(run.summary)
        load = run.provenance.get("machine_load") or {}
        row.update({k: load[k] for k in ("other_cpu_pct", "load_average_1m", "busy") if k in load})
        simulated = run_label(run)  # its times are a cost model's: say so beside them
        row["clock"] = "virtual" if run.virtual_clock else "wall"
        if simulated:
            row["simulated"] = simulated
        row["status"] = "error" if run.error else "ok"
        if run.error:
            row["error"] = run.error
        rows.append(row)
    return rows


# -- the report


REPORT_DEFAULTS = {
    "title": None,
    "sort": "output_tok_s",
    "figures": [],
    "claims": [],
    "slo": dict(SLO_DEFAULTS),  # no key set: no SLO
    "time_axis": "steps",  # the x axis of the timeline, KV and batch plots: steps | seconds
    "min_repeats": MIN_REPEATS,  # a figure that varies is decided on at least this many repeats
    "plots": "all",  # which plots to draw: all, none, or a list of names (lab/plots_registry.py)
    "format": "png",  # png | pdf | svg
    "dpi": 150,
    "after_sweep": True,  # `servelab -m` writes the report when the sweep ends (cli.py)
}
REPORT_TYPES = {
    "title": str | None,
    "sort": str,
    "figures": list,
    "claims": list,
    "slo": dict | None,  # {ttft_ms, tpot_ms, itl_ms, percentile}: see lab/slo.py
    "time_axis": str,
    "min_repeats": int,
    "plots": str | list,
    "format": str,
    "dpi": int,
    "after_sweep": bool,
}
TIME_AXES = ("steps", "seconds")
FORMATS = ("png", "pdf", "svg")


def report_options(node: Mapping | None) -> dict:
    """The config's `report:` node with defaults; an unknown key is a ConfigError."""
    options = {k: (type(v)(v) if isinstance(v, (list, dict)) else v)
               for k, v in REPORT_DEFAULTS.items()}  # fmt: skip
    for key, value in (node or {}).items():
        if key not in REPORT_DEFAULTS:
            raise ConfigError(
                f"unknown report option {key!r}; accepted: {', '.join(REPORT_DEFAULTS)}"
            )
        if value is not None:
            options[key] = value
    for key in ("title", "sort", "time_axis", "min_repeats", "plots", "format", "dpi", "after_sweep"):
        check_value(f"report option {key}", options[key], REPORT_TYPES[key])
    if options["min_repeats"] < 2:
        raise ConfigError(
            f"report option min_repeats must be >= 2 (a t interval needs two repeats), "
            f"got {options['min_repeats']!r}"
        )
    if options["format"] not in FORMATS:
        raise ConfigError(
            f"report option format must be one of {', '.join(FORMATS)}, got {options['format']!r}"
        )
    if not 20 <= options["dpi"] <= 1200:
        raise ConfigError(f"report option dpi must be in [20, 1200], got {options['dpi']!r}")
    options["plots"] = plot_names(options["plots"])
    for key in ("figures", "claims"):
        if not isinstance(options[key], (list, tuple)):
            raise ConfigError(f"report option {key} must be a list, got {options[key]!r}")
    options["slo"] = slo_options(options["slo"])
    if options["time_axis"] not in TIME_AXES:
        raise ConfigError(
            f"report option time_axis must be one of {', '.join(TIME_AXES)}, "
            f"got {options['time_axis']!r}"
        )
    options["title"] = options["title"] or "servelab sweep"
    options["figures"], options["claims"] = list(options["figures"]), list(options["claims"])
    return options


def report_settings(runs: Sequence[Run], overrides: Sequence[str] = ()) -> dict:
    """The first run's stored `report:` options, with `overrides` (`report.KEY=VALUE`,
    lab/report_overrides.py) applied; `given` lists the overrides."""
    stored = (runs[0].results.get("config") or {}).get("report")
    settings = report_options(apply_overrides(stored, overrides, REPORT_DEFAULTS))
    settings["given"] = list(overrides)
    return settings


def write_report(
    paths: Sequence[str | Path],
    out: str | Path | None = None,
    progress: bool = True,
    overrides: Sequence[str] = (),
) -> Path:
    """Loads the runs under `paths`; writes the tables, the claims and the plots,
    showing its progress (lab/progress.py) unless `progress` is False. The
    report options are the stored runs', with `overrides` applied."""
    return report(paths, out, progress, overrides).out


@dataclass
class Written:
    """What `report` wrote, and the claims it decided."""

    out: Path
    claims: list[ClaimResult]
    settings: dict
    plots: list[str]


def report(
    paths: Sequence[str | Path],
    out: str | Path | None = None,
    progress: bool = True,
    overrides: Sequence[str] = (),
) -> Written:
    """`write_report`, returning the claims and the plots drawn too."""
    runs = load_runs(paths)
    fixed = mark_swept(runs)
    settings = report_settings(runs, overrides)
    add_slo_figures(runs, settings["slo"])
    configs = sort_configs(group_runs(runs), settings["sort"])
    out = Path(out) if out else (Path(paths[0]) if len(paths) == 1 else Path("servelab-report"))
    out.mkdir(parents=True, exist_ok=True)

    slo_figures = ["slo_attainment_pct", "goodput_rps"] if settings["slo"] else []
    cluster = [
        name
        for name in (*CLUSTER_FIGURES, *SPECULATION_FIGURES)
        if any(name in run.summary for run in runs)
    ]
    shown = list(dict.fromkeys(
        [settings["sort"], *KEY_FIGURES, *slo_figures, *cluster, *settings["figures"]]
    ))  # fmt: skip
    text = set(_text_keys(runs))  # shown as they are (summary_rows adds them as text)
    every = [name for name in dict.fromkeys([*shown, *_summary_keys(runs)]) if name not in text]
    plots = wanted_plots(settings)
    settings["simulated"] = report_note(configs)  # every plot's title names a simulation
    with Progress("servelab-report", len(configs) + len(plots) + 1, progress) as bar:
        # the figures per configuration: the percentile bootstraps are most of the work
        for config in configs:
            for name in every:
                estimate(config, name)
            bar.advance(f"estimates of {config.label}")
        write_csv(out / "summary.csv", summary_rows(configs, every))
        write_csv(out / "runs.csv", run_rows(runs))
        claims = evaluate_claims(configs, settings["claims"], settings["min_repeats"])
        capacities = capacity(configs, settings["slo"]) if settings["slo"] else []
        bar.advance("claims")
        written = draw_plots(configs, claims, settings, out, on_done=bar.advance)
    warnings = [f"{w}; their figures may not be comparable"
                for w in mixed_provenance([run.provenance for run in runs])]  # fmt: skip
    warnings += busy_warnings([run for run in runs if not run.virtual_clock])
    text = markdown(settings, configs, fixed, claims, shown, written, warnings, capacities)
    (out / "summary.md").write_text(text)
    return Written(out, claims, settings, written)


def write_csv(path: Path, rows: Sequence[dict]) -> None:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def _text_keys(runs: Sequence[Run]) -> list[str]:
    keys: list[str] = []
    for run in runs:
        keys += [k for k, v in run.summary.items() if k not in keys and isinstance(v, str)]
    return keys


def _summary_keys(runs: Sequence[Run]) -> list[str]:
    keys: list[str] = []
    for run in runs:
        keys += [k for k, v in run.summary.items() if k not in keys and isinstance(v, (int, float))]
    return keys


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        prog="servelab-report",
        description="Turn servelab run folders (or a multirun folder) into summary.csv, "
        "summary.md and plots.",
    )
    parser.add_argument(
        "paths", nargs="+", metavar="PATH|report.KEY=VALUE",
        help="run folders or folders above them; then report options that override the "
        "stored ones (report.slo.ttft_ms=200 report.time_axis=seconds), the claims decided "
        "again on the stored runs",
    )  # fmt: skip
    parser.add_argument("--out", help="where to write (default: the only PATH)")
    args = parser.parse_intermixed_args(argv)  # paths and options before or after --out
    paths = [p for p in args.paths if not is_override(p)]
    if not paths:
        parser.error("no run folder given")
    overrides = [p for p in args.paths if is_override(p)]
    out = write_report(paths, args.out, overrides=overrides)
    print(f"servelab-report: wrote {out / 'summary.md'}, {out / 'summary.csv'} and plots in {out}")
    print((out / "summary.md").read_text())
    return out
