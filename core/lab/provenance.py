"""What produced a run: code, libraries, machine, config and command line, as
`results.json` records it under `provenance`, and the report's check that a
sweep's runs come from one machine and one set of versions.

The machine's load during a run (`machine_load`: the load average, and the
share of the CPUs other processes used while it served) is recorded too: a
timed figure from a busy machine is slower and noisier, and the report marks
such runs instead of letting them pass as comparable."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

LIBRARIES = ("servelab", "torch", "triton", "transformers")
# what must agree between the runs of one report for them to be compared
COMPARED = ("servelab", "git_commit", "python", "torch", "triton", "transformers", "machine")


def provenance(config: Mapping, model: str) -> dict[str, Any]:
    """The code, library versions, machine, config hash, command line and start
    time of a run about to start; `model` is what the engine loaded."""
    found: dict[str, Any] = {lib: _version(lib) for lib in LIBRARIES}
    found.update(
        git_commit=git_commit(),
        python=platform.python_version(),
        machine=machine(),
        model=model,
        config_hash=config_hash(config),
        command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        started=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    return found


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The checkout's commit (with `+dirty` for uncommitted changes) when servelab
    runs from a git checkout; None for an installed wheel."""
    source = Path(__file__).resolve().parents[2]
    if not (source / ".git").exists():
        return None
    try:
        commit = _git(source, "rev-parse", "HEAD")
        dirty = _git(source, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def _git(folder: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10, check=True
    )
    return done.stdout.strip()


def machine() -> str:
    """The GPU model (with the device count) where CUDA is up, else the CPU model
    and its core count."""
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"{cpu_model()}, {os.cpu_count()} cores"


def cpu_info() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where it is missing)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines)}


def cpu_model() -> str:
    return cpu_info().get("model name") or platform.processor() or platform.machine()


def cpu_generation() -> str:
    """`cpu_model` with its family and model numbers, which tell generations apart where
    the name does not (a virtual machine's \"AMD EPYC\" is Zen 1 to Zen 5)."""
    info = cpu_info()
    family, model = info.get("cpu family"), info.get("model")
    return f"{cpu_model()} (family {family} model {model})" if family else cpu_model()


def config_hash(config: Mapping) -> str:
    """A short hash of the resolved config (keys sorted): equal hashes, equal configs."""
    text = json.dumps(config, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# other processes using this share of every CPU's time make a run "busy"
BUSY_OTHER_CPU_PCT = 25.0


def cpu_snapshot() -> dict[str, float] | None:
    """The machine's busy and total CPU seconds so far (/proc/stat, every core)
    and this process's own; None where /proc is missing."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    ticks = [float(v) for v in fields]
    hz = float(os.sysconf("SC_CLK_TCK"))
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0.0)  # idle + iowait
    own = os.times()
    return {"total": sum(ticks[:8]) / hz, "busy": (sum(ticks[:8]) - idle) / hz,
            "own": own.user + own.system + own.children_user + own.children_system}  # fmt: skip


def machine_load(before: Mapping | None, after: Mapping | None) -> dict[str, Any]:
    """The load between two snapshots: load averages now, other processes' share
    of the machine's CPU time (percent of every core together), and `busy`."""
    load: dict[str, Any] = {"cpus": os.cpu_count()}
    try:
        load["load_average_1m"], load["load_average_5m"], _ = (round(v, 2) for v in os.getloadavg())
    except OSError:
        pass
    if before and after:
        total = after["total"] - before["total"]
        other = (after["busy"] - before["busy"]) - (after["own"] - before["own"])
        # a run shorter than the clock tick (10 ms) sees no tick pass: nothing measurable ran
        share = 100.0 * other / total if total > 0 else 0.0
        load["other_cpu_pct"] = round(min(100.0, max(0.0, share)), 1)
        load["busy"] = load["other_cpu_pct"] >= BUSY_OTHER_CPU_PCT
    return load


def busy_warnings(runs: Sequence[Any]) -> list[str]:
    """One warning naming the runs whose machine was busy, if any."""
    loads = [(run, (run.provenance or {}).get("machine_load") or {}) for run in runs]
    busy = [(run, load) for run, load in loads if load.get("busy")]
    if not busy:
        return []
    worst = max(load.get("other_cpu_pct", 0.0) for _, load in busy)
    return [
        f"{len(busy)} of {len(runs)} runs ran on a busy machine (other processes used up to "
        f"{worst:g}% of the CPUs; busy: {BUSY_OTHER_CPU_PCT:g}% or more): their timed figures "
        "are slower and noisier (runs.csv: other_cpu_pct, busy)"
    ]


def mixed_provenance(records: Sequence[Mapping | None]) -> list[str]:
    """One warning per compared field whose value differs between the runs."""
    warnings = []
    for field in COMPARED:
        values = sorted({str((record or {}).get(field)) for record in records})
        if len(values) > 1:
            warnings.append(f"the runs differ in {field}: {', '.join(values)}")
    return warnings
