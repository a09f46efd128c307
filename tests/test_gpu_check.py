"""`benchmarks/gpu_check.sh --dry-run` runs every phase of the device check on the CPU
(a few of the marked tests, Triton interpreted, the tiny model per backend with graphs
off and on) and writes the merged JSON and Markdown, so the script cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = [
    "setup",
    "tests:gpu",
    "bench:triton_paged-off",
    "bench:triton_paged-on",
    "bench:flash_varlen-off",
    "bench:padded-off",
    "bench:per_request-off",
    "report",
]
RESULT_FILES = {
    "env.txt",
    "tests.log",
    "bench.log",
    "records.jsonl",
    "gpu_check.json",
    "gpu_check.md",
}


def test_dry_run_runs_every_phase_and_writes_the_report(tmp_path):
    # a shared CPU imports torch slowly: the dry run's limits are the plan's x DRY_RUN_SCALE
    env = {"DRY_RUN_SCALE": "10", **os.environ, "PYTHON": sys.executable}
    env.pop("TRITON_INTERPRET", None)  # the script sets it for the dry run
    done = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--dry-run", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # at most 6 files come back from a lent machine: the check writes exactly these
    assert {p.name for p in tmp_path.iterdir()} == RESULT_FILES
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    phases = {p["name"]: p for p in report["phases"]}
    assert list(phases) == PHASES
    assert all(p["status"] == "ok" for p in phases.values()), phases
    # the plan's limits, setup and report included, fit 6 minutes of device time
    assert sum(int(p["limit_s"]) for p in phases.values()) <= 6 * 60
    runs = {(r["backend"], r["graphs"]): r for r in report["runs"]}
    assert set(runs) == {tuple(name[6:].rsplit("-", 1)) for name in PHASES[2:-1]}
    assert all(r["status"].startswith("ok") and r["output_tokens"] > 0 for r in runs.values())
    assert all(r["requests_done"] == r["requests"] == 2 for r in runs.values())
    assert all(r["bandwidth"] > 0 for r in runs.values())  # each process measured its own
    assert any("eager" in n for n in runs["triton_paged", "on"]["notes"])  # no graphs on a CPU
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert all(f"| {name} | ok |" in markdown for name in PHASES)
    assert "| triton_paged | on |" in markdown
    tests_log = (tmp_path / "tests.log").read_text()
    assert " passed" in tests_log and "failed" not in tests_log
