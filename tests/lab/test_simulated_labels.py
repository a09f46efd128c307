"""A result from the simulated executor says so wherever it is shown: the
report's text and tables, runs.csv, every plot's title, the per-run table,
the sweep's job line and results.json name the executor, the hardware profile,
the model, virtual time and the profile's measured accuracy (or that it has none)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from servelab.engine.summary import summarize
from servelab.lab import plots, plots_claims
from servelab.lab.report import evaluate_claims, group_runs, load_runs, write_report
from servelab.lab.runner import RunResult, print_summary, run_config, save_run
from servelab.lab.simulated_label import accuracy, label, simulation
from tests.lab.test_report import CLAIMS, fake_records

HARDWARE = Path(__file__).parents[2] / "conf" / "hardware"
H100 = "simulated: executor=simulated, hardware=h100-sxm, model=llama3-8b, virtual time"
H100_ACCURACY = "median abs error 7.4% (operators), 6.3% (all-reduce) against measured times"


def profile(name: str) -> dict:
    return yaml.safe_load((HARDWARE / f"{name}.yaml").read_text())


@pytest.mark.parametrize(
    "name, expected",
    [
        ("h100-sxm", "median abs error 7.4% (operators), 6.3% (all-reduce)"),
        ("a100-80g", "median abs error 5.7% (operators), 4.2% (all-reduce)"),
        ("h200", "median abs error 5.7% (all-reduce)"),
        ("h100-sxm-fa3", "median abs error 7.4% (operators), 6.3% (all-reduce), 7.8% (attention)"),
        ("rtx-pro-6000", "median abs error 7.1% (operators), 6.0% (attention)"),
        ("cpu-local", "median abs error 21.7% (steps)"),
        ("l40s", None),
    ],
)
def test_the_accuracy_is_read_from_the_profiles_sources(name, expected):
    assert accuracy(profile(name)) == expected


def test_a_profile_without_a_measured_accuracy_says_so():
    found = simulation({"executor": {"virtual_clock": True, "hardware": profile("l40s")},
                        "model": "qwen3-8b"}, {"executor": "simulated", "hardware": "l40s"})  # fmt: skip
    assert label(found) == ("simulated: executor=simulated, hardware=l40s, model=qwen3-8b, "
                            "virtual time; cost model accuracy not measured (profile basis: datasheet)")  # fmt: skip
    assert simulation({"executor": {"virtual_clock": False}}) is None


def simulated_sweep(root: Path) -> Path:
    """Two fake runs recorded as the simulated executor records them."""
    for job, (name, step) in enumerate((("slow", 0.1), ("fast", 0.05))):
        requests, steps = fake_records(3, step)
        config = {"report": {"title": "Simulated", "claims": CLAIMS[:1], "plots": ["throughput", "claims"]},
                  "run": {"repeat": 0}}  # fmt: skip
        meta = {"overrides": [f"scheduler={name}"],
                "choices": {"scheduler": name, "executor": "simulated", "hardware": "h100-sxm",
                            "model": "llama3-8b"}}  # fmt: skip
        provenance = {"model": "llama3-8b",
                      "executor": {"virtual_clock": True, "hardware": profile("h100-sxm")}}  # fmt: skip
        result = RunResult(None, summarize(requests, steps), requests, steps, provenance)
        save_run(root / str(job), result, config, meta)
    return root


def test_the_report_text_and_runs_csv_name_the_simulation(tmp_path):
    out = write_report([simulated_sweep(tmp_path / "sweep")], progress=False)
    text = (out / "summary.md").read_text()
    assert text.count(f"{H100}; cost model {H100_ACCURACY}") == 2  # the claims' and the table's
    assert "exact for the cost model" in text
    with open(out / "runs.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["clock"] for row in rows] == ["virtual", "virtual"]
    assert {row["simulated"] for row in rows} == {f"{H100}; cost model {H100_ACCURACY}"}


def test_every_plot_title_names_the_simulation(tmp_path, monkeypatch):
    titled: list[str] = []
    real_save = plots.save

    def save(fig, path):
        real_save(fig, path)  # which stamps the note
        titled.append("\n".join([fig.get_suptitle(), *(t.get_text() for t in fig.texts)]))

    monkeypatch.setattr(plots, "save", save)
    monkeypatch.setattr(plots_claims, "save", save)
    monkeypatch.setattr("os.cpu_count", lambda: 1)  # drawn here, where save is watched
    out = write_report([simulated_sweep(tmp_path / "sweep")], progress=False)
    assert sorted(p.name for p in out.glob("*.png")) == ["claims.png", "throughput.png"]
    assert len(titled) == 2
    for title in titled:
        assert "hardware=h100-sxm, model=llama3-8b, virtual time" in title and "7.4%" in title
    claims_title = next(t for t in titled if "Claims" in t)
    assert "95% interval" not in claims_title  # exact figures: no interval is drawn


def test_a_real_report_has_no_simulation_label(tmp_path):
    from tests.lab.test_report import make_multirun

    out = write_report([make_multirun(tmp_path / "real")], progress=False)
    assert "simulated" not in (out / "summary.md").read_text()
    runs = load_runs([out])
    assert evaluate_claims(group_runs(runs), CLAIMS[:1], 2)


def test_a_simulated_run_records_and_prints_its_label():
    config = {"model": "llama3-8b", "executor": "simulated", "hardware": "h100-sxm",
              "engine": {"dtype": "bfloat16", "gpu_memory_utilization": 0.9},
              "workload": {"name": "mixed_lengths", "scale": 0.05},
              "run": {"progress": False, "warmup": False}}  # fmt: skip
    result = run_config(config)
    found = result.provenance["simulated"]
    assert label(found) == f"{H100}; cost model {H100_ACCURACY}"
    console = Console(record=True, width=200)
    print_summary(result.summary, title="run", console=console, simulated=found)
    shown = console.export_text()
    assert H100 in shown and "virtual_time_s" in shown and "wall_time_s" not in shown
    json.dumps(result.provenance)  # results.json can hold it
