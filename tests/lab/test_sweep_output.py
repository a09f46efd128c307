"""What a sweep prints: one line per job (its choices, its headline figures, its
folder; or its error), never the per-run table or serving progress, and the
claims' verdicts when it ends; if any job failed, a last line naming the failed
jobs, and the sweep exits 1. The report's progress names only plots drawn."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from servelab.cli import ReportAtSweepEnd
from servelab.lab import sweep
from servelab.lab.plots_registry import draw_plots
from servelab.lab.report import group_runs, load_runs, report_options
from tests.lab.test_presets import SERVELAB
from tests.lab.test_report import make_multirun


@pytest.fixture(autouse=True)
def no_sweep_running():
    """`sweep.start` notes the sweep for the jobs that follow; each test starts afresh."""
    sweep.SWEEP.clear()
    yield
    sweep.SWEEP.clear()


def sweep_config(folder, params, task):
    return OmegaConf.create({"hydra": {"sweep": {"dir": str(folder)}, "sweeper": {"params": params},
                                       "overrides": {"task": task}}})  # fmt: skip


def test_a_job_line_names_the_swept_choices_its_figures_and_its_folder(tmp_path):
    config = sweep_config(tmp_path, {"run.repeat": "range(1)", "scheduler": "static,continuous"},
                          ["attention=padded,per_request", "model=tiny"])  # fmt: skip
    opening = sweep.start(config)
    assert opening == f"servelab: sweep of 4 jobs over scheduler, attention into {tmp_path}"
    overrides = ["run.repeat=0", "scheduler=static", "attention=padded", "model=tiny"]
    summary = {"output_tok_s": 12540.0, "ttft_p50_ms": 40.0, "itl_p50_ms": 8.5, "preemptions": 0}
    line = sweep.job_line(2, overrides, tmp_path / "2", summary)
    assert line == ("servelab: job 3/4 scheduler=static attention=padded: 12,540 output tok/s, "
                    f"40 ms TTFT p50, 8.5 ms ITL p50, 0 preemptions -> {tmp_path / '2'}")  # fmt: skip
    failed = sweep.job_line(0, overrides, tmp_path / "0", error="KV cache too small")
    assert (
        failed == "servelab: job 1/4 scheduler=static attention=padded: error: KV cache too small"
    )
    assert "\n" not in line + failed


def test_a_command_line_value_wins_over_the_presets_sweep(tmp_path):
    config = sweep_config(tmp_path, {"scheduler": "static,continuous", "workload.rate": "1,2,4"},
                          ["workload.rate=8"])  # fmt: skip
    assert sweep.start(config).startswith("servelab: sweep of 2 jobs over scheduler into")


def test_the_sweep_ends_with_the_claims_verdicts(tmp_path, capsys):
    folder = make_multirun(tmp_path / "multirun")
    ended = OmegaConf.create({"hydra": {"sweep": {"dir": str(folder)}}, "report": {}})
    ReportAtSweepEnd().on_multirun_end(ended)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"servelab: sweep folder: {folder}"
    assert out[1] == "servelab: claims:"
    claims = [line for line in out if line.startswith("- ")]
    assert len(claims) == 3  # the stored claims, one line each
    assert any("fast beats slow" in line for line in claims)
    assert out[-1] == f"servelab: report: {folder / 'summary.md'}"
    assert len(out) == 2 + 3 + 1 + 1  # folder, heading, claims, the indicative note, report


def test_the_report_progress_names_only_the_plots_it_drew(tmp_path):
    runs = load_runs([make_multirun(tmp_path / "multirun")])
    settings = report_options({"plots": ["throughput", "goodput", "fairness"]})
    said: list[str] = []
    written = draw_plots(group_runs(runs), [], settings, tmp_path, on_done=said.append)
    assert written == ["throughput.png"]  # no SLO, no clients: nothing to draw for the others
    assert sorted(said) == sorted(["plot throughput", "no goodput plot (nothing to draw)",
                                   "no fairness plot (nothing to draw)"])  # fmt: skip


def test_the_sweep_ends_naming_its_failed_jobs(tmp_path):
    for num, block, status in [(1, "0", "error"), (2, "16", "ok"), (10, "0", "error")]:
        overrides = [f"run.repeat={num // 2}", f"allocator.block_size={block}"]
        results = {"status": status, "overrides": overrides, "job": {"num": num}, "summary": {}}
        (tmp_path / str(num)).mkdir()
        (tmp_path / str(num) / "results.json").write_text(json.dumps(results))
    # in the order of the jobs (not of their folders' names), as their lines said them
    assert sweep.finish(tmp_path) == (
        "servelab: 2 of 3 jobs failed: job 2 allocator.block_size=0, job 11 allocator.block_size=0"
    )
    assert sweep.SWEEP["failed"]
    for num in (1, 10):
        (tmp_path / str(num) / "results.json").unlink()
    assert sweep.finish(tmp_path) is None and not sweep.SWEEP["failed"]
    (tmp_path / "2" / "results.json").unlink()
    assert sweep.finish(tmp_path) == (
        f"servelab: no job of the sweep wrote its results.json into {tmp_path}"
    )
    assert sweep.SWEEP["failed"]


def servelab_command() -> list[str]:
    return [str(SERVELAB)] if SERVELAB.exists() else [
        sys.executable, "-c", "from servelab.cli import main; main()"]  # fmt: skip


@pytest.mark.slow  # a subprocess running a sweep
def test_a_sweep_whose_every_job_fails_exits_1_naming_them(tmp_path):
    done = subprocess.run(
        [*servelab_command(), "-m", "executor=simulated", "hardware=cpu-local",
         "scheduler=static,continuous", "allocator.block_size=0", f"hydra.sweep.dir={tmp_path}",
         "report.plots=none"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    error = "error: allocator block_size must be a positive integer, got 0"
    assert done.stderr.splitlines() == [
        f"servelab: job 1/2 scheduler=static: {error}",
        f"servelab: job 2/2 scheduler=continuous: {error}",
        "servelab: 2 of 2 jobs failed: job 1 scheduler=static, job 2 scheduler=continuous",
    ]
    # the report is still written, and lists them
    assert done.stdout.splitlines()[-1] == f"servelab: report: {tmp_path / 'summary.md'}"
    assert "## Failed runs (2)" in (tmp_path / "summary.md").read_text()


@pytest.mark.slow  # a subprocess running a sweep
def test_a_sweep_prints_one_line_per_job_and_its_verdicts(tmp_path):
    command = servelab_command()
    claims = ('report.claims=[{text: static idles, figure: idle_slot_pct, run: "scheduler=static",'
              ' at_least: 10}]')  # fmt: skip
    done = subprocess.run(
        [*command, "-m", "executor=simulated", "hardware=cpu-local", "scheduler=static,continuous",
         "attention=padded,per_request", f"hydra.sweep.dir={tmp_path}", "report.plots=none",
         claims],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    jobs = [
        line
        for line in lines
        if re.match(r"servelab: job \d/4 scheduler=\w+ attention=\w+: ", line)
    ]
    assert len(jobs) == 4
    assert lines[0].startswith("servelab: sweep of 4 jobs over scheduler, attention into")
    # the claim is decided at each attention value: one verdict line each
    assert (
        lines[-4] == "servelab: claims:"
        and lines[-1] == f"servelab: report: {tmp_path / 'summary.md'}"
    )
    assert [line.split(" — ")[0] for line in lines[-3:-1]] == ["- ✅ holds: static idles"] * 2
    assert len(lines) == 1 + 4 + 1 + 1 + 2 + 1  # opening, jobs, folder, heading, verdicts, report
    assert "serving:" not in done.stdout + done.stderr and "HYDRA" not in done.stdout + done.stderr


def test_a_cluster_job_in_a_sweep_prints_one_labelled_line(tmp_path, capsys):
    from servelab.lab.cluster.cli_run import run_cluster_job
    from tests.lab.cluster.test_simulated_cluster import config

    meta = {"overrides": ["router=round_robin"], "job": {"num": 0},
            "choices": {"executor": "simulated", "model": "tiny", "router": "round_robin"}}  # fmt: skip
    run_cluster_job(config(), meta, tmp_path / "0", in_sweep=True)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("servelab: job 1 router=round_robin: ")
    assert out[0].endswith(f" (simulated on cpu-local, virtual time) -> {tmp_path / '0'}")
