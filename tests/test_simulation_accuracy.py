"""benchmarks/simulation_accuracy.py cannot rot: its smoke mode calibrates on
one pass of the grid, predicts two small held-out workloads and writes its table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_the_accuracy_benchmark_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELAB_BENCH_SMOKE", "1")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import simulation_accuracy

    monkeypatch.setattr(simulation_accuracy, "calibrate", lambda out, threads, repeats: "cpu-local")
    assert simulation_accuracy.main(["--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "accuracy.json").read_text())
    assert [r["workload"] for r in rows] == ["static-paged-once", "static-contiguous-r16"]
    for row in rows:
        assert row["same_tokens_out"]
        for key in simulation_accuracy.FIGURES:
            assert row[key]["measured"] > 0 and row[key]["predicted"] > 0
    table = (tmp_path / "accuracy.md").read_text()
    assert table.count("\n") == 2 + len(rows) + 1 and "median abs error" in table
    sys.modules.pop("simulation_accuracy", None)
