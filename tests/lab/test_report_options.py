"""`servelab-report DIR report.KEY=VALUE ...`: report options given on its
command line override the ones stored with the runs, and the claims, the SLO
figures and the plots are decided again on the stored runs (nothing reruns)."""

from __future__ import annotations

import json

import pytest

from servelab.cli import report_main
from servelab.errors import ConfigError
from servelab.lab.report import REPORT_DEFAULTS as KEYS
from servelab.lab.report_overrides import apply_overrides
from tests.lab.test_report import make_multirun, read_summary

MISSES = ('report.claims=[{text: the slowest misses the SLO, figure: slo_attainment_pct, '
          'run: "scheduler=slowest", at_most: 0}]')  # fmt: skip


@pytest.fixture
def stored(tmp_path):
    return make_multirun(tmp_path / "multirun")


def test_command_line_options_override_the_stored_ones_without_rerunning(stored, capsys):
    results = sorted(stored.rglob("results.json"))
    before = [path.read_text() for path in results]
    # TTFT is one step: 50 ms (fast), 100 ms (slow), 200 ms (slowest)
    report_main([str(stored), "report.slo.ttft_ms=150", MISSES, "report.min_repeats=2",
                 "report.title=Reread", "report.time_axis=seconds"])  # fmt: skip
    text = (stored / "summary.md").read_text()
    assert text.startswith("# Reread\n")
    assert "✅ holds: the slowest misses the SLO" in text
    assert "fast beats slow" not in text  # the stored claims were replaced
    assert "report.slo.ttft_ms=150" in text  # the report says what it was given
    rows = {row["scheduler"]: row for row in read_summary(stored / "summary.csv")}
    assert float(rows["fast"]["slo_attainment_pct"]) == 100.0
    assert float(rows["slowest"]["slo_attainment_pct"]) == 0.0
    assert [path.read_text() for path in results] == before  # the runs are as stored
    assert len(results) == 6
    capsys.readouterr()


def test_options_may_follow_out(stored, tmp_path, capsys):
    out = tmp_path / "elsewhere"
    report_main(["--out", str(out), str(stored), "report.title=After out"])
    assert (out / "summary.md").read_text().startswith("# After out\n")
    report_main([str(stored), "--out", str(out), "report.title=Also after out"])
    assert (out / "summary.md").read_text().startswith("# Also after out\n")
    capsys.readouterr()


def test_the_options_merge_into_the_stored_node_as_hydra_would():
    stored = {"title": "T", "slo": {"ttft_ms": 100, "percentile": 95}, "claims": [{"x": 1}]}
    merged = apply_overrides(stored, ["report.slo.tpot_ms=20", "++report.sort=ttft_p50_ms"], KEYS)
    assert merged["slo"] == {"ttft_ms": 100, "tpot_ms": 20, "percentile": 95}
    assert merged["sort"] == "ttft_p50_ms" and merged["claims"] == [{"x": 1}]
    assert apply_overrides({"slo": None}, ["report.slo.ttft_ms=5"], KEYS)["slo"] == {"ttft_ms": 5}
    assert apply_overrides(stored, ["report.slo={itl_ms: 9}"], KEYS)["slo"] == {"itl_ms": 9}
    assert apply_overrides(stored, ["~report.slo"], KEYS)["slo"] is None
    assert stored["slo"] == {"ttft_ms": 100, "percentile": 95}  # not changed in place


@pytest.mark.parametrize(
    "override, message",
    [
        ("report.colour=red", "unknown report option 'colour'; accepted: after_sweep, claims, dpi"),
        ("report.slo.ttft=1", "unknown report.slo option 'ttft'; accepted: itl_ms, percentile"),
        ("time_axis=seconds", "takes report options as report.KEY=VALUE (report.time_axis="),
        ("scheduler=chunked", "takes report options as report.KEY=VALUE"),
        ("report.time_axis=minutes", "time_axis must be one of steps, seconds, got 'minutes'"),
        ("report.time_axis=steps,seconds", "one value each, not a sweep"),
        ("report.slo={ttft", "cannot read 'report.slo={ttft'"),
    ],
)
def test_a_bad_option_is_one_error_naming_the_valid_keys(stored, capsys, override, message):
    with pytest.raises(SystemExit) as exit_:
        report_main([str(stored), override])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("servelab-report: error: ") and message in err
    assert err.count("\n") == 1  # one line, no traceback


def test_apply_overrides_raises_config_errors():
    with pytest.raises(ConfigError, match="unknown report option 'bogus'"):
        apply_overrides({}, ["report.bogus=1"], KEYS)
    assert json.dumps(apply_overrides({}, [], KEYS)) == "{}"


def test_report_options_given_to_a_sweep_are_not_configuration_choices():
    from servelab.lab.runs import run_params

    results = {"overrides": ["scheduler=a", "report.slo.ttft_ms=5"], "choices": {"model": "tiny"}}
    assert run_params(results) == {"scheduler": "a", "model": "tiny"}
