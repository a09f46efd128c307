"""What a sweep (`servelab -m`) prints: one line when it starts (how many jobs,
which keys vary), one line per job (what it chose, its key figures, its
folder; or its error), and at the end the claims' verdicts, so a preset of a
hundred jobs reads in a screen. Every table and plot is in the report.

The line per job needs the sweep's size, known only to the sweep: the
`ReportAtSweepEnd` callback (cli.py) calls `start` with the sweep's config,
and the jobs, run in the same process by Hydra's basic launcher, read it. A
launcher that runs jobs elsewhere (joblib, ray, submitit) gets lines without
the total. A job that fails records its error and the sweep goes on; when it
ends, `finish` names the failed jobs, and the sweep exits 1 if any failed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from servelab.errors import ConfigError
from servelab.lab.runs import fmt, load_runs

# the sweep now running in this process: its size and the keys whose values vary; once
# it has ended, whether any of its jobs failed (`servelab` then exits 1)
SWEEP: dict[str, Any] = {}


def start(config: Any) -> str:
    """Notes the sweep about to run; returns its opening line."""
    jobs = sweep_jobs(config)
    SWEEP.clear()
    if jobs is None:
        return f"servelab: sweep into {config.hydra.sweep.dir}"
    varying = [k for k in dict.fromkeys(key for job in jobs for key in job)
               if len({job.get(k) for job in jobs}) > 1]  # fmt: skip
    SWEEP.update(total=len(jobs), varying=varying)
    over = f" over {', '.join(varying)}" if varying else ""
    return f"servelab: sweep of {len(jobs)} jobs{over} into {config.hydra.sweep.dir}"


def sweep_jobs(config: Any) -> list[dict[str, str]] | None:
    """Each job's overrides as Hydra's basic sweeper forms them (its params, then
    the command line's); None where they cannot be worked out here."""
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        params = config.hydra.sweeper.get("params") or {}
        arguments = [f"{k}={v}" for k, v in params.items()]
        arguments += list(config.hydra.overrides.task)
        overrides = OverridesParser.create().parse_overrides(arguments)
        batches = BasicSweeper.split_arguments(overrides, None)
    except Exception:  # noqa: BLE001 (a glob or another launcher's sweep: no total, no harm)
        return None
    return [dict(o.split("=", 1) for o in job) for batch in batches for job in batch]


def job_line(num: int | None, overrides: Sequence[str], folder: Any, summary: Mapping | None = None,
             error: str | None = None, simulated: Mapping | None = None) -> str:  # fmt: skip
    """`servelab: job 3/12 scheduler=static: 512 output tok/s, 40 ms TTFT p50, ... -> DIR`;
    a simulated run's figures are marked as the cost model's (`simulated`: its record)."""
    total = SWEEP.get("total")
    where = f"job {num + 1}" if num is not None else "job"
    where += f"/{total}" if total and num is not None else ""
    chosen = dict(o.lstrip("+~").split("=", 1) for o in overrides if "=" in o)
    varying = SWEEP.get("varying")
    shown = [f"{k}={v}" for k, v in chosen.items() if varying is None or k in varying]
    head = f"servelab: {where}" + (f" {' '.join(shown)}" if shown else "")
    if error is not None:
        return f"{head}: error: {error}"
    clock = f" (simulated on {simulated['hardware']}, virtual time)" if simulated else ""
    return f"{head}: {figures_text(summary or {})}{clock} -> {folder}"


def finish(folder: Path) -> str | None:
    """After the sweep: the line naming the jobs that failed (`status: error` in
    their results.json below `folder`), or None if none did; notes in SWEEP
    whether any did. No results.json at all counts as every job failing."""
    try:
        runs = load_runs([folder])
    except ConfigError:
        runs = []
    failed = [run for run in runs if run.results.get("status") == "error"]
    SWEEP["failed"] = bool(failed) or not runs
    if not runs:
        return f"servelab: no job of the sweep wrote its results.json into {folder}"
    if not failed:
        return None
    named = {}
    for run in failed:  # as its line said it: `job 3 scheduler=static` (its folder if no number)
        num = (run.results.get("job") or {}).get("num")
        name = f"job {num + 1}" if isinstance(num, int) else str(run.folder.relative_to(folder))
        key = (num if isinstance(num, int) else len(runs), str(run.folder))
        named[key] = " ".join([name, *(f"{k}={v}" for k, v in run.swept.items())])
    listed = ", ".join(named[key] for key in sorted(named))
    return f"servelab: {len(failed)} of {len(runs)} jobs failed: {listed}"


def figures_text(summary: Mapping) -> str:
    """A run's headline figures in a few words."""
    parts = []
    for key, unit in (("output_tok_s", "output tok/s"), ("ttft_p50_ms", "ms TTFT p50"),
                      ("itl_p50_ms", "ms ITL p50"), ("preemptions", "preemptions")):  # fmt: skip
        value = summary.get(key)
        if isinstance(value, (int, float)):
            parts.append(f"{fmt(value)} {unit}")
    return ", ".join(parts) or "done"


def verdict_lines(claims: Sequence, settings: Mapping) -> list[str]:
    """The claims' verdicts as summary.md states them, and what an indicative
    one still needs."""
    from servelab.lab.report_markdown import claim_line
    from servelab.lab.stats import INDICATIVE

    lines = [claim_line(claim) for claim in claims]
    indicative = [c for c in claims if c.verdict == INDICATIVE]
    if indicative:
        more = max(c.more_repeats for c in indicative)
        lines.append(f"  ({len(indicative)} indicative: run {more} more repeat(s), "
                     f"run.repeats={settings['min_repeats']} or more, to decide them)")  # fmt: skip
    return lines
