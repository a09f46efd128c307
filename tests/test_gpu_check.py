"""`benchmarks/gpu_check.sh --dry-run` runs every phase of the device check on the CPU
(a few tests of each file, Triton interpreted, the tiny model per backend with graphs
off and on) and writes the merged JSON and Markdown, so the script cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = [
    "tests:executor",
    "tests:triton_kernels",
    "tests:triton_fused",
    "tests:triton_sm90",
    "bench:triton_paged-off",
    "bench:triton_paged-on",
    "bench:flash_varlen-off",
    "bench:padded-off",
    "bench:per_request-off",
]


def test_dry_run_runs_every_phase_and_writes_the_report(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("TRITON_INTERPRET", None)  # the script sets it for the dry run
    done = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--dry-run", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    phases = {p["name"]: p for p in report["phases"]}
    assert list(phases) == PHASES
    assert all(p["status"] == "ok" for p in phases.values()), phases
    # each phase under its own limit; with setup (15 s) and the report (10 s) below 8 minutes
    assert sum(int(p["limit_s"]) for p in phases.values()) + 15 + 10 < 8 * 60
    runs = {(r["backend"], r["graphs"]): r for r in report["throughput"]["runs"]}
    assert set(runs) == {tuple(name[6:].rsplit("-", 1)) for name in PHASES[4:]}
    assert all(r["status"].startswith("ok") and r["output_tokens"] > 0 for r in runs.values())
    assert any("eager" in n for n in runs["triton_paged", "on"]["notes"])  # no graphs on a CPU
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert all(f"| {name} | ok |" in markdown for name in PHASES)
    assert "| triton_paged | on |" in markdown
