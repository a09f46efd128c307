"""`servelab-report`: run folders -> summary.csv (best first), summary.md (every
run, the claims evaluated) and PNG plots that open and are not blank."""

from __future__ import annotations

import csv

import pytest
from PIL import Image

from servelab.cli import report_main
from servelab.engine.metrics import RequestRecord, StepRecord, summarize
from servelab.errors import ConfigError
from servelab.lab.report import assign_slots, evaluate_claims, load_runs, write_report
from servelab.lab.runner import RunResult, save_run

PLOTS = ("throughput.png", "ttft_cdf.png", "itl_cdf.png", "kv_util.png", "timeline.png")


def fake_records(num_requests: int, step_time: float, idle: int = 0):
    """`num_requests` requests of 3 tokens each, one step per token, all decoding together."""
    steps = [
        StepRecord(i, i * step_time, step_time, num_requests, 0 if i else 4 * num_requests,
                   num_requests if i else 0, idle, 0, 10 * (i + 1), 16 * (i + 1), 1000)
        for i in range(3)
    ]  # fmt: skip
    requests = [
        RequestRecord(f"r{k}", 0.0, 4, 3, 0.0, step_time, 3 * step_time, "length", 0,
                      token_times=[(i + 1) * step_time for i in range(3)],
                      token_steps=[0, 1, 2], first_scheduled_step=0, finished_step=2)
        for k in range(num_requests)
    ]  # fmt: skip
    return requests, steps


def write_run(folder, overrides, step_time, claims=(), num_requests=3, idle=0):
    requests, steps = fake_records(num_requests, step_time, idle)
    summary = summarize(requests, steps)
    config = {"report": {"title": "A fake sweep", "sort": "output_tok_s", "figures": ["steps"],
                         "claims": list(claims)}}  # fmt: skip
    meta = {"overrides": overrides, "choices": {"scheduler": "continuous", "model": "tiny"}}
    save_run(folder, RunResult(None, summary, requests, steps), config, meta)
    return summary


CLAIMS = [
    {"text": "fast beats slow", "figure": "output_tok_s", "run": "scheduler=fast",
     "vs": "scheduler=slow", "ratio_at_least": 2.0},
    {"text": "slow is not that slow", "figure": "output_tok_s", "run": "scheduler=slow",
     "at_least": 1e9},
    {"text": "a missing run", "figure": "output_tok_s", "run": "scheduler=absent", "at_least": 1},
]  # fmt: skip


@pytest.fixture
def multirun(tmp_path):
    root = tmp_path / "multirun"
    # step times 0.1, 0.05 and 0.2 s: output tok/s 3 x 3 / (3 x step)
    write_run(root / "0", ["scheduler=slow", "workload.scale=0.5"], 0.1, CLAIMS)
    write_run(root / "1", ["scheduler=fast", "workload.scale=0.5"], 0.05, CLAIMS)
    write_run(root / "2", ["scheduler=slowest", "workload.scale=0.5"], 0.2, CLAIMS, idle=2)
    return root


def read_summary(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_summary_csv_has_one_row_per_run_best_first(multirun):
    out = write_report([multirun])
    rows = read_summary(out / "summary.csv")
    assert [row["scheduler"] for row in rows] == ["fast", "slow", "slowest"]
    # swept choices come first; what every run shares is not a column
    assert list(rows[0])[:2] == ["run", "scheduler"] and "workload.scale" not in rows[0]
    assert float(rows[0]["output_tok_s"]) == pytest.approx(9 / 0.15)
    assert float(rows[2]["idle_slot_pct"]) == pytest.approx(100 * 6 / 15)


def test_markdown_lists_every_run_and_states_the_claims(multirun):
    text = (write_report([multirun]) / "summary.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(table) == 1 + 3  # header + one row per run
    for name in ("fast", "slow", "slowest"):
        assert any(f"| {name} |" in row for row in table)
    assert "# A fake sweep" in text and "`workload.scale=0.5`" in text
    assert "✅ holds: fast beats slow" in text and "2× [claim ≥ 2×]" in text
    assert "❌ does not hold: slow is not that slow" in text
    assert "⚠️ cannot check: a missing run" in text
    for plot in PLOTS:
        assert f"({plot})" in text


def test_plots_open_and_are_not_blank(multirun):
    out = write_report([multirun])
    for plot in PLOTS:
        with Image.open(out / plot) as image:
            image.load()
            assert image.width > 100 and image.height > 100
            colors = image.convert("L").getextrema()
            assert colors[0] < colors[1], f"{plot} is one flat colour"


def test_no_slot_timeline_for_large_workloads(tmp_path):
    write_run(tmp_path / "big", ["scheduler=x"], 0.1, num_requests=80)
    out = write_report([tmp_path / "big"])
    assert not (out / "timeline.png").exists()
    assert (out / "throughput.png").exists()


def test_ratio_claims_pair_runs_that_share_the_other_swept_values(tmp_path):
    for i, (sched, alloc, step) in enumerate(
        [("fast", "a", 0.05), ("slow", "a", 0.1), ("fast", "b", 0.1), ("slow", "b", 0.1)]
    ):
        write_run(tmp_path / str(i), [f"scheduler={sched}", f"allocator={alloc}"], step)
    runs = load_runs([tmp_path])
    results = evaluate_claims(runs, [CLAIMS[0]])
    assert [r.holds for r in results] == [True, False]
    assert "at allocator=a" in results[0].text and "at allocator=b" in results[1].text


def test_bad_claims_and_paths_are_config_errors(tmp_path, multirun):
    runs = load_runs([multirun])
    with pytest.raises(ConfigError, match="exactly one of"):
        evaluate_claims(runs, [{"figure": "output_tok_s", "run": "scheduler=fast"}])
    with pytest.raises(ConfigError, match="give `vs`"):
        evaluate_claims(runs, [{"figure": "x", "run": "scheduler=fast", "ratio_at_least": 2}])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no run"):
        load_runs([tmp_path / "empty"])
    with pytest.raises(SystemExit) as exit_info:
        report_main([str(tmp_path / "nowhere")])
    assert exit_info.value.code == 2


def test_cli_writes_into_out_from_several_folders(tmp_path, capsys):
    write_run(tmp_path / "a", ["scheduler=one"], 0.1)
    write_run(tmp_path / "b", ["scheduler=two"], 0.2)
    report_main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "rep")])
    out = tmp_path / "rep"
    assert [r["scheduler"] for r in read_summary(out / "summary.csv")] == ["one", "two"]
    assert "summary.md" in capsys.readouterr().out


def test_slots_are_assigned_greedily_by_start():
    # (0, 1) takes slot 0, (0, 4) slot 1, (2, 5) reuses slot 0, (5, 6) reuses slot 1
    assert assign_slots([(0, 4), (0, 1), (2, 5), (5, 6)]) == [1, 0, 0, 1]
    assert assign_slots([(0, 3), (3, 4)]) == [0, 1]  # step 3 is still held by the first
