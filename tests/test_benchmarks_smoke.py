"""The benchmark suite (benchmarks/, not part of the default test run) still
works: every group runs once at smoke size (`SERVELAB_BENCH_SMOKE=1`), without
timing (`--benchmark-disable`), in a child pytest; the server-vs-offline script
runs one pair of fresh processes, pinned as asked, and finds equal tokens.

The C++ decode kernel is switched off (`SERVELAB_CPU_KERNEL=0`): building it
takes half a minute on a fresh machine, and its fallback path is what runs.
"""

from __future__ import annotations

import json
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


@pytest.mark.parametrize("own_client_process", [False, True])
def test_serve_vs_offline_runs_each_side_in_a_fresh_pinned_process(tmp_path, own_client_process):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from serve_vs_offline import order
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert order(3) == ["offline", "server", "server", "offline", "offline", "server"]
    cpu = min(os.sched_getaffinity(0))
    out = tmp_path / "serve_vs_offline.json"
    env = {**os.environ, "SERVELAB_BENCH_SMOKE": "1", "SERVELAB_CPU_KERNEL": "0"}
    command = [sys.executable, str(ROOT / "benchmarks" / "serve_vs_offline.py"),
               "--repeats", "1", "--cpu", str(cpu), "--threads", "1", "--json", str(out)]  # fmt: skip
    if own_client_process:  # the server in a process of its own (here on the same CPU)
        command += ["--client-cpu", str(cpu)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    figures = json.loads(out.read_text())
    runs = figures["runs"]
    assert [r["side"] for r in runs] == ["offline", "server"] == figures["order"]
    assert len({r["pid"] for r in runs} | {os.getpid()}) == 3  # each side its own process
    assert all(r["cpus"] == [cpu] and r["torch_threads"] == 1 for r in runs)
    assert figures["tokens_identical"] and runs[0]["tokens"] == runs[1]["tokens"]
    assert runs[0]["output_tokens"] > 0 and figures["median_added_ttft_ms"] is not None
    assert "ratio server/offline" in result.stdout


def test_tp_allreduce_reports_both_sizes_and_leaves_no_worker():
    env = {**os.environ, "SERVELAB_BENCH_SMOKE": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tp_allreduce.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("tp=")]
    assert [line.split()[0] for line in lines] == ["tp=1", "tp=2"], result.stdout
    # the embeddings' and two per layer (tiny: 2 layers), then the logits' gather
    assert "(5 per step)" in lines[1] and "gather" in lines[1], lines[1]


def test_router_balance_compares_the_routers_paired_by_seed():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "router_balance.py"), "--cases", "low",
         "--seeds", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()
            if line.split() and "paired" not in line
            and line.split()[0] in ("least_load", "prefix_affinity", "prefix_affinity:0")}  # fmt: skip
    assert len(rows) == 3
    assert rows["prefix_affinity:0"][-3:] == ["4.000", "±", "0.000"]  # all 32 on one replica
    assert result.stdout.count("- least_load, paired:") == 2


def test_cpu_decode_matmuls_reports_each_dtype_and_row_count():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cpu_decode_matmuls.py"), "--layers", "1",
         "--vocab", "4096", "--rows", "1", "2", "--repeats", "1", "--threads", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if "projections" in line]
    assert [line.split()[:3] for line in lines] == [
        ["float32", "rows", "1:"], ["float32", "rows", "2:"],
        ["bfloat16", "rows", "1:"], ["bfloat16", "rows", "2:"],
    ]  # fmt: skip
    assert all("GB/s" in line for line in lines) and "over the plain weight" in lines[-1]
    assert result.stdout.startswith("CPU: ")
