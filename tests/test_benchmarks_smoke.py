"""The benchmark suite (benchmarks/, not part of the default test run) still
works: every group runs once at smoke size (`SERVELAB_BENCH_SMOKE=1`), without
timing (`--benchmark-disable`), in a child pytest.

The C++ decode kernel is switched off (`SERVELAB_CPU_KERNEL=0`): building it
takes half a minute on a fresh machine, and its fallback path is what runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GROUPS = (
    "test_allocators",
    "test_scheduler_overhead",
    "test_attention",
    "test_matmul",
    "test_end_to_end",
    "test_vs_transformers",
)


def test_every_benchmark_group_runs(tmp_path):
    pytest.importorskip("pytest_benchmark")
    report = tmp_path / "report.xml"
    env = {**os.environ, "SERVELAB_BENCH_SMOKE": "1", "SERVELAB_CPU_KERNEL": "0"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(ROOT / "benchmarks"),
            "-q",
            "-p",
            "no:cacheprovider",
            "--benchmark-disable",
            f"--junitxml={report}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    passed: dict[str, int] = {}
    for case in ET.parse(report).iter("testcase"):
        if case.find("skipped") is None and case.find("failure") is None:
            module = case.get("classname", "").split(".")[-1]
            passed[module] = passed.get(module, 0) + 1
    missing = [group for group in GROUPS if not passed.get(group)]
    assert not missing, f"benchmark groups that ran no test: {missing} (ran: {passed})"
