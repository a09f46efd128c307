"""What produced a run: code, libraries, machine, config and command line, as
`results.json` records it under `provenance`, and the report's check that a
sweep's runs come from one machine and one set of versions."""

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


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def config_hash(config: Mapping) -> str:
    """A short hash of the resolved config (keys sorted): equal hashes, equal configs."""
    text = json.dumps(config, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def mixed_provenance(records: Sequence[Mapping | None]) -> list[str]:
    """One warning per compared field whose value differs between the runs."""
    warnings = []
    for field in COMPARED:
        values = sorted({str((record or {}).get(field)) for record in records})
        if len(values) > 1:
            warnings.append(f"the runs differ in {field}: {', '.join(values)}")
    return warnings
