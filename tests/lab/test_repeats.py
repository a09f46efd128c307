"""Repeats: `run.repeats=N` runs a configuration N times with fresh engines; in
a sweep the repeat index varies slowest, so the configurations interleave; the
report takes the repeats of a configuration as one row with intervals."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

from servelab.lab.report import write_report

BIN = Path(sys.executable).parent
SMALL = ["workload.scale=0.05", "workload.repeat=1", "run.progress=false", "run.warmup=false"]


def servelab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "servelab"), *args], capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_a_sweep_interleaves_the_repeats_of_its_configurations(tmp_path):
    sweep = tmp_path / "sweep"
    done = servelab("-m", "run.repeats=2", "scheduler=static,continuous",
                    f"hydra.sweep.dir={sweep}", *SMALL)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    order = []
    for job in range(4):
        results = json.loads((sweep / str(job) / "results.json").read_text())
        order.append((results["config"]["run"]["repeat"], results["choices"]["scheduler"]))
    assert order == [(0, "static"), (0, "continuous"), (1, "static"), (1, "continuous")]
    out = write_report([sweep])
    with open(out / "summary.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert sorted(r["scheduler"] for r in rows) == ["continuous", "static"]
    assert all(r["runs"] == "2" for r in rows)
    # the workload is the same in every repeat: the same requests, the same tokens
    digests = {json.loads((sweep / str(j) / "results.json").read_text())["summary"][
        "output_digest"] for j in range(4)}  # fmt: skip
    assert len(digests) == 1


def test_one_configuration_repeated_without_a_sweep(tmp_path):
    done = servelab("run.repeats=2", f"hydra.run.dir={tmp_path}", *SMALL)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.parent.name for p in tmp_path.glob("*/results.json")) == [
        "repeat-0",
        "repeat-1",
    ]
    assert "servelab-report" in done.stdout
    with open(write_report([tmp_path]) / "summary.csv", newline="") as handle:
        (row,) = list(csv.DictReader(handle))
    assert row["runs"] == "2"


def test_repeats_must_be_positive(tmp_path):
    done = servelab("run.repeats=0", f"hydra.run.dir={tmp_path}", *SMALL)
    assert done.returncode == 2 and "run option repeats must be >= 1" in done.stderr
