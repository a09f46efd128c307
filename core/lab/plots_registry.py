"""Which plots a report draws, and drawing them: a registry of named plot
functions, so a plot module adds its own (`register_plot`) instead of editing
the report; `report.plots` picks some (default: all), `report.format` the file
type (png | pdf | svg) and `report.dpi` the resolution.

Plots are independent of each other, so with more than one core they are drawn
in worker processes (forked: the estimates computed so far come along, nothing
is pickled but the plot's name). A plot function takes a `PlotJob` and a path
and returns False when it has nothing to draw (that file is not written).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from servelab.errors import ConfigError


@dataclass
class PlotJob:
    configs: Sequence  # the finished configurations, best first
    claims: Sequence  # the decided ClaimResults
    settings: Mapping  # the report options

    @property
    def axis(self) -> str:
        return self.settings.get("time_axis", "steps")


PlotFunction = Callable[[PlotJob, Path], "bool | None"]
PLOTS: dict[str, PlotFunction] = {}  # name (the file's stem) -> function, in the report's order


def register_plot(name: str, function: PlotFunction) -> None:
    """Adds a plot to every report: `name.<format>` drawn by `function(job, path)`."""
    PLOTS[name] = function


def _builtin() -> None:
    # imported here: each plot module imports matplotlib only when it draws
    from servelab.lab import (
        plots,
        plots_claims,
        plots_fairness,
        plots_goodput,
        plots_load,
        plots_replicas,
        plots_speculation,
        plots_workload,
    )

    builtin = {
        "claims": lambda job, p: plots_claims.plot_claims(job.claims, p),
        "throughput": lambda job, p: plots.plot_throughput(job.configs, p, job.claims),
        "latency_vs_load": lambda job, p: plots_load.plot_latency_vs_load(
            job.configs, p, job.settings.get("slo")
        ),
        "latency_cdf": lambda job, p: plots.plot_latency_cdfs(job.configs, p),
        "kv_util": lambda job, p: plots.plot_kv_use(job.configs, p, job.axis),
        "batch": lambda job, p: plots.plot_batches(job.configs, p, job.axis),
        "timeline": lambda job, p: plots.plot_timeline(job.configs, p, job.axis),
        "fairness": lambda job, p: plots_fairness.plot_fairness(job.configs, p),
        "workload": lambda job, p: plots_workload.plot_workloads(
            [run for config in job.configs for run in config.runs], p
        ),
        "goodput": lambda job, p: plots_goodput.plot_goodput(
            job.configs, p, job.settings.get("slo")
        ),
        "replicas": lambda job, p: plots_replicas.plot_replicas(job.configs, p),
        "speculation": lambda job, p: plots_speculation.plot_speculation(job.configs, p),
    }
    for name, function in builtin.items():
        PLOTS.setdefault(name, function)


def plot_names(choice: str | Sequence[str]) -> list[str]:
    """`all` | `none` | a list of names -> the names; an unknown name is an error."""
    _builtin()
    if isinstance(choice, str):
        if choice in ("all", "none"):
            return list(PLOTS) if choice == "all" else []
        choice = [choice]
    unknown = [name for name in choice if name not in PLOTS]
    if unknown:
        raise ConfigError(
            f"report option plots: unknown plot {', '.join(map(repr, unknown))}; "
            f"accepted: all, none, or a list of {', '.join(PLOTS)}"
        )
    return list(dict.fromkeys(choice))


def wanted_plots(settings: Mapping) -> list[str]:
    return plot_names(settings.get("plots", "all"))


_JOB: tuple[PlotJob, Path, str] | None = None  # what a forked worker draws from


def _draw(name: str) -> tuple[str, bool]:
    from servelab.lab.plots import configure

    job, out, fmt = _JOB
    configure(job.settings)
    path = out / f"{name}.{fmt}"
    return name, PLOTS[name](job, path) is not False and path.exists()


def draw_plots(configs, claims, settings: Mapping, out: Path,
               on_done: Callable[..., None] | None = None) -> list[str]:  # fmt: skip
    """Draws the wanted plots the report has data for; returns the files written."""
    global _JOB
    names = wanted_plots(settings)
    finished = [c for c in configs if c.finished]
    if not finished or not names:
        for name in names:
            on_done and on_done(_done_text(name, False))
        return []
    fmt = settings.get("format", "png")
    _JOB = (PlotJob(finished, claims, settings), Path(out), fmt)
    drawn: dict[str, bool] = {}
    workers = min(len(names), os.cpu_count() or 1)
    if workers > 1 and sys.platform == "linux":
        import multiprocessing

        from servelab.lab.plots import pyplot

        pyplot()  # imported once, before the workers fork, not once in each
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            for done in as_completed([pool.submit(_draw, name) for name in names]):
                name, ok = done.result()
                drawn[name] = ok
                on_done and on_done(_done_text(name, ok))
    else:
        for name in names:
            drawn[name] = _draw(name)[1]
            on_done and on_done(_done_text(name, drawn[name]))
    return [f"{name}.{fmt}" for name in names if drawn.get(name)]


def _done_text(name: str, drawn: bool) -> str:
    """What the progress says of one plot: drawn, or nothing to draw (no file)."""
    return f"plot {name}" if drawn else f"no {name} plot (nothing to draw)"
