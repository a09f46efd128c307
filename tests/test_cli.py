"""The `servelab` command: one run writes results.json / requests.csv /
steps.csv and prints its summary; a typo exits 2 naming the accepted keys;
`hydra/launcher=joblib` runs a sweep in parallel; options a plugin registers
through `servelab_register_configs` work on the command line;
`servelab-report` runs as a console script."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import textwrap
from pathlib import Path

from servelab.engine.build import build_engine
from servelab.lab.runner import serve
from servelab.lab.workload import make_workload

BIN = Path(sys.executable).parent
SMALL = ["workload.scale=0.05", "run.progress=false", "engine.num_threads=1"]


def servelab(*args: str, script: str | None = None) -> subprocess.CompletedProcess:
    command = [str(BIN / "servelab"), *args]
    if script is not None:
        command = [sys.executable, "-c", script, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_one_run_writes_its_results_and_prints_the_summary(tmp_path):
    done = servelab(
        "scheduler=chunked", "scheduler.chunk_size=4", f"hydra.run.dir={tmp_path}", *SMALL
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "output_tok_s" in done.stdout and "scheduler=chunked" in done.stdout
    # the run folder on a line of its own, whole, to copy (not wrapped in the table's title)
    assert f"servelab: run folder: {tmp_path}" in done.stdout.splitlines()
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["scheduler"] == {
        "name": "chunked",
        "admission": "on_demand",
        "order": "fcfs",
        "chunk_size": 4,
    }
    assert "scheduler.chunk_size=4" in results["overrides"]
    assert results["choices"]["scheduler"] == "chunked"
    summary = results["summary"]
    assert summary["requests"] == 8 and summary["finished_pct"] == 100
    with open(tmp_path / "requests.csv", newline="") as handle:
        requests = list(csv.DictReader(handle))
    with open(tmp_path / "steps.csv", newline="") as handle:
        steps = list(csv.DictReader(handle))
    assert len(requests) == 8 and len(steps) == summary["steps"]
    assert sum(int(r["output_tokens"]) for r in requests) == summary["output_tokens"]
    for row in requests:
        assert len(json.loads(row["token_times"])) == len(json.loads(row["token_steps"]))


def test_a_misspelt_option_exits_2_and_lists_the_accepted_keys(tmp_path):
    done = servelab(
        "scheduler=chunked", "+scheduler.chunk_sise=4", f"hydra.run.dir={tmp_path}", *SMALL
    )
    assert done.returncode == 2
    assert "servelab: error: unknown option 'chunk_sise'" in done.stderr
    assert "chunk_size" in done.stderr and "admission" in done.stderr
    done = servelab("+workload.repet=2", f"hydra.run.dir={tmp_path}", *SMALL)
    assert done.returncode == 2 and "'repet'" in done.stderr and "repeat" in done.stderr


def test_joblib_launcher_runs_a_sweep_and_the_report_reads_it(tmp_path):
    sweep = tmp_path / "sweep"
    done = servelab(
        "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "scheduler=static,continuous",
        f"hydra.sweep.dir={sweep}", *SMALL,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.parent.name for p in sweep.glob("*/results.json")) == ["0", "1"]
    report = subprocess.run(
        [str(BIN / "servelab-report"), str(sweep)], capture_output=True, text=True, timeout=120
    )
    assert report.returncode == 0, report.stderr[-2000:]
    with open(sweep / "summary.csv", newline="") as handle:
        assert sorted(row["scheduler"] for row in csv.DictReader(handle)) == [
            "continuous",
            "static",
        ]


def test_a_failing_job_does_not_end_its_sweep_and_the_report_lists_it(tmp_path):
    sweep = tmp_path / "sweep"
    done = servelab("-m", "allocator.block_size=0,16", f"hydra.sweep.dir={sweep}", *SMALL)
    # the sweep ran every job and wrote its report, then exits 1: a job failed
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"servelab: report: {sweep / 'summary.md'}\n" in done.stdout
    # the failed job's one line: which job, what it chose, why it failed; the last line
    # names the jobs that failed
    assert (
        "servelab: job 1/2 allocator.block_size=0: error: "
        "allocator block_size must be a positive integer, got 0\n" in done.stderr
    )
    assert done.stderr.splitlines()[-1] == (
        "servelab: 1 of 2 jobs failed: job 1 allocator.block_size=0"
    )
    failed = json.loads((sweep / "0" / "results.json").read_text())
    assert (
        failed["status"] == "error" and "block_size must be a positive integer" in failed["error"]
    )
    assert "allocator.block_size=0" in failed["overrides"]
    assert json.loads((sweep / "1" / "results.json").read_text())["status"] == "ok"  # it ran
    report = subprocess.run(
        [str(BIN / "servelab-report"), str(sweep)], capture_output=True, text=True, timeout=120
    )
    assert report.returncode == 0, report.stderr[-2000:]
    with open(sweep / "summary.csv", newline="") as handle:
        rows = {row["allocator.block_size"]: row for row in csv.DictReader(handle)}
    assert rows["0"]["status"] == "error" and "block_size" in rows["0"]["error"]
    assert rows["16"]["status"] == "ok" and float(rows["16"]["output_tok_s"]) > 0
    summary = (sweep / "summary.md").read_text()
    assert "## Failed runs (1)" in summary and "block_size must be a positive integer" in summary


def test_a_failing_single_run_exits_2_and_still_writes_its_results(tmp_path):
    done = servelab("allocator.block_size=0", f"hydra.run.dir={tmp_path}", *SMALL)
    assert done.returncode == 2 and "block_size must be a positive integer" in done.stderr
    assert json.loads((tmp_path / "results.json").read_text())["status"] == "error"


def test_a_plugin_registered_config_option_works_on_the_command_line(tmp_path):
    script = textwrap.dedent(
        """
        import sys
        from servelab import hookimpl
        from servelab.registry.plugin_manager import get_plugin_manager

        class AddsConfigs:
            @hookimpl
            def servelab_register_configs(self, store):
                node = {"name": "continuous", "admission": "reserve"}
                store.store(group="scheduler", name="reserving", node=node)

        get_plugin_manager().register(AddsConfigs(), name="adds-configs")
        sys.argv[0] = "servelab"
        from servelab.cli import main
        main()
        """
    )
    done = servelab("scheduler=reserving", f"hydra.run.dir={tmp_path}", *SMALL, script=script)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["scheduler"] == {"name": "continuous", "admission": "reserve"}


def test_the_progress_bar_runs_without_a_terminal():
    engine = build_engine({"model": "tiny", "engine": {"num_threads": 1}})
    requests = make_workload(
        {"name": "mixed_lengths", "scale": 0.05}, engine.model_config.vocab_size
    )
    assert serve(engine, requests, progress=True)["requests"] == 8


def test_the_readme_commands_run(tmp_path):
    # the quick start's default run, and the classic baseline from the README
    for args in ([], ["scheduler=static", "allocator=contiguous", "attention=padded"]):
        done = servelab(*args, f"hydra.run.dir={tmp_path / str(len(args))}", "run.progress=false")
        assert done.returncode == 0, done.stderr[-2000:]
        assert "output_tok_s" in done.stdout
        results = json.loads((tmp_path / str(len(args)) / "results.json").read_text())
        assert results["summary"]["finished_pct"] == 100
