"""`servelab bench serve` replays a workload against a live server and writes the
runner's files, with client-measured latencies and the offline run's tokens."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

from servelab.engine.build import build_engine
from servelab.lab.runner import serve
from servelab.lab.workload import make_workload
from tests.serve.harness import Running, server_config

WORKLOAD = {"name": "mixed_lengths", "seed": 0, "repeat": 1, "scale": 0.1, "temperature": 0.0,
            "ignore_eos": True, "arrival": "all_at_once"}  # fmt: skip


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
