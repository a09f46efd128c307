"""`servelab bench serve` replays a workload against a live server and writes the
runner's files, with client-measured latencies and the offline run's tokens."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from servelab.cli import report_main
from servelab.engine.build import build_engine
from servelab.lab.runner import serve
from servelab.lab.workload import make_workload
from tests.serve.harness import Running, server_config

WORKLOAD = {"name": "mixed_lengths", "seed": 0, "repeat": 1, "scale": 0.1, "temperature": 0.0,
            "ignore_eos": True, "arrival": "all_at_once"}  # fmt: skip
SERVELAB = str(Path(sys.executable).parent / "servelab")


def test_bench_serve_writes_the_runner_files(model_folder, tmp_path):
    model = {"path": str(model_folder)}
    offline = build_engine({"model": model, "engine": {"dtype": "float64", "max_model_len": 256}})
    requests = make_workload(WORKLOAD, offline.model_config.vocab_size, offline.max_model_len)
    want = serve(offline, requests)["output_digest"]
    with Running(server_config(model)) as server:
        port = server.options["port"]
        servelab = os.path.join(os.path.dirname(sys.executable), "servelab")
        overrides = [f"workload.{k}={v}" for k, v in WORKLOAD.items() if k != "name"]
        done = subprocess.run(
            [servelab, "bench", "serve", "workload=mixed_lengths", *overrides,
             f"serve.port={port}", "serve.bench_concurrency=4", f"hydra.run.dir={tmp_path}"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["status"] == "ok" and results["mode"] == "bench_serve"
    summary = results["summary"]
    assert summary["requests"] == 8 and summary["output_digest"] == want
    assert summary["output_tok_s"] > 0 and summary["ttft_p50_ms"] > 0
    rows = list(csv.DictReader((tmp_path / "requests.csv").open()))
    assert len(rows) == 8
    assert all(float(r["ttft"]) > 0 and len(json.loads(r["token_times"])) > 0 for r in rows)


def test_servelab_report_reads_a_bench_serve_folder_beside_an_offline_run(model_folder, tmp_path):
    model = f"model.path={model_folder}"
    overrides = [f"workload.{k}={v}" for k, v in WORKLOAD.items() if k != "name"]
    common = [
        "workload=mixed_lengths",
        *overrides,
        "engine.dtype=float64",
        "engine.max_model_len=256",
    ]
    offline, served = tmp_path / "runs" / "offline", tmp_path / "runs" / "served"
    done = subprocess.run([SERVELAB, *common, model, "run.progress=false",
                           f"hydra.run.dir={offline}"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    with Running(server_config({"path": str(model_folder)})) as server:
        done = subprocess.run(
            [SERVELAB, "bench", "serve", *common, f"serve.port={server.options['port']}",
             "serve.bench_concurrency=4", f"hydra.run.dir={served}"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    report_main([str(tmp_path / "runs")])
    rows = list(csv.DictReader((tmp_path / "runs" / "summary.csv").open()))
    assert len(rows) == 2 and all(row["runs"] == "1" for row in rows)
    by_mode = {row["mode"]: row for row in rows}
    assert set(by_mode) == {"", "bench_serve"}  # the served run is told apart by its mode
    # the server's parts are the run's choices: the same as the offline run's, so no column
    assert not {"scheduler", "allocator", "attention", "serve.port"} & set(rows[0])
    for folder, mode in ((offline, ""), (served, "bench_serve")):
        summary = json.loads((folder / "results.json").read_text())["summary"]
        row = by_mode[mode]
        assert float(row["output_tok_s"]) == pytest.approx(summary["output_tok_s"])
        assert float(row["ttft_p50_ms"]) == pytest.approx(summary["ttft_p50_ms"])
        by_mode[mode] = summary
    assert by_mode[""]["output_digest"] == by_mode["bench_serve"]["output_digest"]
    # a figure only the engine counts is missing for the client, not zero
    assert by_mode["bench_serve"]["kv_util_pct"] is None and by_mode[""]["kv_util_pct"] > 0
    markdown = (tmp_path / "runs" / "summary.md").read_text()
    assert "`scheduler=continuous`" in markdown and "bench_serve" in markdown
    # the same provenance: comparable runs (a busy-machine warning depends on the load: allowed)
    assert "the runs differ in" not in markdown
