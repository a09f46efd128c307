"""Run folders as `servelab-report` reads them: a run is a folder holding
`results.json` (its summary, overrides and config-group choices), with
`requests.csv` and `steps.csv` beside it. A run's params are its `key=value`
overrides, then its group choices; the ones that differ between the runs of a
report are its swept choices, the rest are the same in every run.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servelab.errors import ConfigError

# the preset is the same in every run of it; a repeat is the same configuration again
# not a configuration: a repeat's index, a server's address and key (`bench serve`)
IGNORED_PARAMS = ("experiment", "run.repeat", "serve.host", "serve.port", "serve.api_key")


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
    def error(self) -> str | None:
        """The message of a run that failed (`status: error`), else None."""
        return self.results.get("error") if self.results.get("status") == "error" else None

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.swept.items()) or self.folder.name

    @property
    def repeat(self) -> int:
        """Which repeat of its configuration this run is (0 when not repeated)."""
        run_node = (self.results.get("config") or {}).get("run") or {}
        return int(run_node.get("repeat", 0) or 0)

    @property
    def provenance(self) -> dict:
        return self.results.get("provenance") or {}

    @property
    def virtual_clock(self) -> bool:
        """Timed by a modelled clock (executor=simulated): its times are as
        deterministic as its counts."""
        return bool((self.provenance.get("executor") or {}).get("virtual_clock"))

    def requests(self) -> list[dict]:
        return read_csv(self.folder / "requests.csv")

    def steps(self) -> list[dict]:
        return read_csv(self.folder / "steps.csv")


@dataclass
class Configuration:
    """The runs of one configuration: the repeats of the same swept choices."""

    swept: dict[str, str]
    runs: list[Run]
    # figure name -> its estimate (lab/estimates.py): a bootstrap is worth computing once
    estimates: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.swept.items()) or "every run"

    @property
    def params(self) -> dict[str, str]:
        return self.runs[0].params

    @property
    def error(self) -> str | None:
        """The first failed repeat's message (its figures come from the others)."""
        return next((run.error for run in self.runs if run.error), None)

    @property
    def finished(self) -> list[Run]:
        return [run for run in self.runs if not run.error]

    @property
    def deterministic(self) -> bool:
        """Every figure is a function of the config alone: each run had a virtual clock."""
        return bool(self.finished) and all(run.virtual_clock for run in self.finished)

    def values(self, name: str) -> list[float]:
        """The figure of every finished repeat."""
        return [figure(run, name) for run in self.finished]


def group_runs(runs: Sequence[Run]) -> list[Configuration]:
    """Runs with equal swept choices (repeats) as one Configuration each, in
    the order their first run comes."""
    groups: dict[tuple, Configuration] = {}
    for run in runs:
        key = tuple(sorted(run.swept.items()))
        groups.setdefault(key, Configuration(dict(run.swept), [])).runs.append(run)
    return list(groups.values())


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
    if results.get("mode"):  # how the run was measured (`bench_serve`: by a client)
        params.setdefault("mode", normalize(results["mode"]))
    # the report's options say how to read the runs, not what they ran
    return {k: v for k, v in params.items()
            if k not in IGNORED_PARAMS and not k.startswith("report.")}  # fmt: skip


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
    if len({tuple(sorted(run.params.items())) for run in runs}) == 1:
        # one configuration (perhaps repeated): what the user chose is what it shows
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


def figure(run: Run, name: str) -> float:
    value = run.summary.get(name)
    return float(value) if isinstance(value, (int, float)) else math.nan


def fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)
