"""`servelab-report`: run folders -> summary.csv (one row per configuration,
best first, with intervals), runs.csv, summary.md (every configuration, the
claims decided) and PNG plots that open and are not blank."""

from __future__ import annotations

import csv

import pytest
from PIL import Image

from servelab.cli import report_main
from servelab.engine.metrics import RequestRecord, StepRecord
from servelab.engine.summary import summarize
from servelab.errors import ConfigError
from servelab.lab.report import evaluate_claims, group_runs, load_runs, write_report
from servelab.lab.runner import RunResult, save_run

PLOTS = ("claims.png", "throughput.png", "latency_cdf.png", "kv_util.png", "batch.png",
         "timeline.png")  # fmt: skip


def fake_records(num_requests: int, step_time: float, idle: int = 0, preempt: bool = False):
    """`num_requests` requests of 3 tokens each, one step per token, all decoding together."""
    steps = [
        StepRecord(i, i * step_time, step_time, num_requests, 0 if i else 4 * num_requests,
                   num_requests if i else 0, idle, 0, 10 * (i + 1), 16 * (i + 1), 1000)
        for i in range(3)
    ]  # fmt: skip
    requests = [
        RequestRecord(f"r{k}", 0.0, 4, 3, 0.0, step_time, 3 * step_time, "length", int(preempt),
                      token_times=[(i + 1) * step_time for i in range(3)],
                      token_steps=[0, 1, 2], first_scheduled_step=0, finished_step=2,
                      preemption_events=[[1, "swap"]] if preempt else [])
        for k in range(num_requests)
    ]  # fmt: skip
    return requests, steps


def write_run(folder, overrides, step_time, claims=(), num_requests=3, idle=0, repeat=0):
    requests, steps = fake_records(num_requests, step_time, idle, preempt=idle > 0)
    summary = summarize(requests, steps)
    config = {"report": {"title": "A fake sweep", "sort": "output_tok_s", "figures": ["steps"],
                         "claims": list(claims)}, "run": {"repeat": repeat}}  # fmt: skip
    meta = {"overrides": overrides, "choices": {"scheduler": "continuous", "model": "tiny"}}
    save_run(folder, RunResult(None, summary, requests, steps), config, meta)
    return summary


CLAIMS = [
    {"text": "fast beats slow", "figure": "output_tok_s", "run": "scheduler=fast",
     "vs": "scheduler=slow", "ratio_at_least": 1.8},
    {"text": "slow is not that slow", "figure": "output_tok_s", "run": "scheduler=slow",
     "at_least": 1e9},
    {"text": "a missing run", "figure": "output_tok_s", "run": "scheduler=absent", "at_least": 1},
]  # fmt: skip


def make_multirun(root, jitters=(1.0, 1.02)):
    """Three configurations, a repeat per jitter; the repeats' step times differ
    by the jitter so each figure has a spread. Step times 0.1, 0.05, 0.2 s:
    output tok/s 3 x 3 / (3 x step)."""
    job = 0
    for repeat, jitter in enumerate(jitters):
        for name, step, idle in (("slow", 0.1, 0), ("fast", 0.05, 0), ("slowest", 0.2, 2)):
            overrides = [f"run.repeat={repeat}", f"scheduler={name}", "workload.scale=0.5"]
            write_run(root / str(job), overrides, step * jitter, CLAIMS, idle=idle, repeat=repeat)
            job += 1
    return root


@pytest.fixture
def multirun(tmp_path):
    """Two repeats: too few to decide a timed claim."""
    return make_multirun(tmp_path / "multirun")


@pytest.fixture
def multirun5(tmp_path):
    """Five repeats (report.min_repeats' default): timed claims are decided."""
    return make_multirun(tmp_path / "multirun5", (1.0, 1.02, 0.99, 1.01, 1.03))


def read_summary(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_summary_csv_has_one_row_per_configuration_best_first(multirun):
    out = write_report([multirun])
    rows = read_summary(out / "summary.csv")
    assert [row["scheduler"] for row in rows] == ["fast", "slow", "slowest"]
    # swept choices come first; what every configuration shares is not a column
    assert list(rows[0])[:2] == ["scheduler", "runs"] and "workload.scale" not in rows[0]
    assert "run.repeat" not in rows[0] and rows[0]["runs"] == "2"
    # the mean of 9 / 0.15 and 9 / (0.15 x 1.02), and its interval from scipy's t
    from scipy import stats

    values = [9 / 0.15, 9 / (0.15 * 1.02)]
    low, high = stats.t.interval(0.95, 1, loc=sum(values) / 2, scale=stats.sem(values))
    assert float(rows[0]["output_tok_s"]) == pytest.approx(sum(values) / 2)
    assert float(rows[0]["output_tok_s_ci_low"]) == pytest.approx(low)
    assert float(rows[0]["output_tok_s_ci_high"]) == pytest.approx(high)
    # a counted figure every repeat agrees on is exact
    assert float(rows[2]["idle_slot_pct"]) == pytest.approx(100 * 6 / 15)
    assert rows[2]["idle_slot_pct_exact"] == "True"
    assert rows[2]["idle_slot_pct_ci_low"] == rows[2]["idle_slot_pct_ci_high"]
    assert len(read_summary(out / "runs.csv")) == 6


def test_markdown_lists_every_configuration_and_decides_the_claims(multirun5):
    text = (write_report([multirun5]) / "summary.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(table) == 1 + 3  # header + one row per configuration
    for name in ("fast", "slow", "slowest"):
        assert any(f"| {name} | 5 |" in row for row in table)
    assert "# A fake sweep" in text and "`workload.scale=0.5`" in text
    # fast / slow: 2x, and the 3% jitter of the repeats keeps the interval within [1.9, 2.1]
    assert "✅ holds: fast beats slow" in text and "[claim ≥ 1.8×]" in text
    assert "(n=5 paired repeats)" in text  # every claim line says what it rests on
    assert "❌ fails: slow is not that slow" in text and "slow; n=5 repeats" in text
    assert "⚠️ cannot check: a missing run" in text
    assert "indicative" not in text
    for plot in PLOTS:
        assert f"({plot})" in text


def test_timed_claims_on_two_repeats_are_indicative(multirun):
    text = (write_report([multirun]) / "summary.md").read_text()
    # the same 2x as with five repeats, but two repeats decide nothing timed
    assert "🔸 indicative (n=2): fast beats slow" in text
    assert "🔸 indicative (n=2): slow is not that slow" in text
    assert "run 3 more repeat(s)" in text and "holds" not in text.split("## Configurations")[0]
    # a counted figure every repeat agrees on is exact: one run decides it
    configs = group_runs(load_runs([multirun]))
    steps = {"figure": "steps", "run": "scheduler=fast", "vs": "scheduler=slow", "ratio_at_most": 1}
    (result,) = evaluate_claims(configs, [steps])
    assert result.verdict == "holds" and "(exact) (n=2)" in result.text
    # report.min_repeats lowers the bar
    (loose,) = evaluate_claims(configs, [CLAIMS[0]], min_repeats=2)
    assert loose.verdict != "indicative" and loose.estimate.n == 2


def test_no_interval_of_a_positive_figure_goes_below_zero(tmp_path):
    # two repeats far apart: a t interval of the mean would reach below zero
    root = make_multirun(tmp_path / "spread", (1.0, 12.0))
    rows = read_summary(write_report([root]) / "summary.csv")
    lows = [float(row[f"{name}_ci_low"]) for row in rows
            for name in ("output_tok_s", "request_throughput", "ttft_p50_ms", "e2e_p50_ms")]  # fmt: skip
    assert min(lows) >= 0 and 0.0 in lows  # cut at zero where the t interval crossed it


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
    configs = group_runs(load_runs([tmp_path]))
    results = evaluate_claims(configs, [CLAIMS[0]])
    # one run a side: no interval, so a timed ratio is never decided
    assert [r.verdict for r in results] == ["indicative", "indicative"]
    assert "at allocator=a" in results[0].text and "at allocator=b" in results[1].text
    assert results[0].estimate.mean == pytest.approx(2.0)
    steps = {"figure": "steps", "run": "scheduler=fast", "vs": "scheduler=slow", "ratio_at_most": 1}
    assert [r.verdict for r in evaluate_claims(configs, [steps])] == ["holds", "holds"]


def test_bad_claims_and_paths_are_config_errors(tmp_path, multirun):
    runs = group_runs(load_runs([multirun]))
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


def test_a_simulated_sweep_says_its_figures_are_exact_and_decides_on_one_run(tmp_path):
    """Runs on a virtual clock: the summary names the executor, the hardware profile and
    the model, says each figure is exact for the cost model, decides a timed claim on one run each (n=1, no interval,
    never indicative), and leaves out the meaningless `device`."""
    import json

    for job, (name, step) in enumerate((("slow", 0.1), ("fast", 0.05))):
        folder = tmp_path / str(job)
        requests, steps = fake_records(3, step, 0, preempt=False)
        config = {"report": {"title": "A simulated sweep", "sort": "output_tok_s",
                             "figures": ["steps"], "claims": CLAIMS[:1]},
                  "run": {"repeat": 0}, "engine": {"device": "cpu"}}  # fmt: skip
        meta = {"overrides": [f"scheduler={name}"],
                "choices": {"scheduler": name, "executor": "simulated", "hardware": "h100-sxm",
                            "model": "llama3-8b"}}  # fmt: skip
        provenance = {"executor": {"virtual_clock": True, "hardware": {"name": "h100-sxm"}}}
        save_run(folder, RunResult(None, summarize(requests, steps), requests, steps, provenance),
                 config, meta)  # fmt: skip
        assert json.loads((folder / "results.json").read_text())["provenance"] == provenance
    text = (write_report([tmp_path]) / "summary.md").read_text()
    assert ("Every run: simulated: executor=simulated, hardware=h100-sxm, model=llama3-8b, "
            "virtual time; cost model accuracy not measured. A virtual clock makes each") in text
    assert "On a virtual clock each figure is exact for the cost model" in text
    assert "one run decides a claim; there are no intervals" in text
    claim = next(line for line in text.splitlines() if "fast beats slow" in line)
    assert "holds" in claim and "(n=1)" in claim and "indicative" not in claim
    assert "confidence intervals" not in text and "`device=" not in text
