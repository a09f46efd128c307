"""The report's plots as a reviewer reads them: chosen by name, in the format
and resolution asked for; ratio panels on a log axis centred on 1; identical
series drawn once and named together; KV panels on one scale."""

from __future__ import annotations

import math

import pytest
from PIL import Image

from servelab.errors import ConfigError
from servelab.lab.plots import same_series
from servelab.lab.plots_claims import _ratio_limits
from servelab.lab.plots_registry import PLOTS, plot_names, register_plot
from servelab.lab.report import report_options, write_report
from servelab.lab.runs import group_runs, load_runs
from servelab.lab.stats import Estimate
from tests.lab.test_report import make_multirun, write_run


def set_report(root, **options) -> None:
    """Rewrites every run's report node with `options` (the preset's, in a real sweep)."""
    import json

    for path in root.rglob("results.json"):
        results = json.loads(path.read_text())
        results["config"]["report"].update(options)
        path.write_text(json.dumps(results))


def test_plots_are_chosen_by_name_in_the_format_asked_for(tmp_path):
    root = make_multirun(tmp_path / "runs")
    set_report(root, plots=["claims", "throughput"], format="svg", dpi=72)
    out = write_report([root], progress=False)
    drawn = sorted(p.name for p in out.iterdir() if p.suffix in (".png", ".svg", ".pdf"))
    assert drawn == ["claims.svg", "throughput.svg"]
    assert (out / "claims.svg").read_text().lstrip().startswith("<?xml")
    assert "![claims](claims.svg)" in (out / "summary.md").read_text()


def test_the_dpi_sets_the_resolution(tmp_path):
    sizes = {}
    for dpi in (50, 100):
        root = make_multirun(tmp_path / f"runs{dpi}")
        set_report(root, plots=["throughput"], dpi=dpi)
        with Image.open(write_report([root], progress=False) / "throughput.png") as image:
            sizes[dpi] = image.width
    assert sizes[100] == pytest.approx(2 * sizes[50], rel=0.05)


def test_bad_plot_options_name_the_valid_choices():
    with pytest.raises(ConfigError, match="accepted: all, none, or a list of claims, throughput"):
        report_options({"plots": ["claims", "thruput"]})
    with pytest.raises(ConfigError, match="png, pdf, svg"):
        report_options({"format": "jpeg"})
    with pytest.raises(ConfigError, match="min_repeats must be >= 2"):
        report_options({"min_repeats": 1})
    assert report_options({"plots": "none"})["plots"] == []


def test_a_plot_module_registers_its_own_plot(tmp_path):
    drawn = []

    def shapes(job, path):
        drawn.append(len(job.configs))
        return False  # nothing to draw: no file, not listed

    register_plot("workload_shape", shapes)
    try:
        assert "workload_shape" in plot_names("all")
        root = make_multirun(tmp_path / "runs")
        set_report(root, plots=["workload_shape"])
        out = write_report([root], progress=False)
        assert "workload_shape" not in (out / "summary.md").read_text()
    finally:
        PLOTS.pop("workload_shape")


def test_ratio_axes_are_centred_on_one():
    claim = type("C", (), {"bars": [("a vs b", Estimate(0.987, 0.01, 0.97, 1.005, 8))]})
    low, high = _ratio_limits([claim], bound=0.95)
    assert low * high == pytest.approx(1.0)  # as far below 1 as above, in fold-change
    assert low < 0.95 and high > 1.005  # the bound and the whole interval show
    assert high < 1.2  # zoomed on the data: a 1% effect is visible, not a sliver of a bar
    wide = type("C", (), {"bars": [("a vs b", Estimate(2.0, 0.1, 1.8, 2.2, 8))]})
    assert _ratio_limits([wide], bound=1.2)[1] > 2.2 and math.isclose(
        math.prod(_ratio_limits([wide], bound=1.2)), 1.0
    )


def test_identical_series_are_drawn_once_and_named_together(tmp_path):
    for i, name in enumerate(("a", "b", "c")):
        write_run(tmp_path / str(i), [f"scheduler={name}"], 0.1, idle=2 if name == "c" else 0)
    configs = group_runs(load_runs([tmp_path]))
    merged = same_series(configs, lambda run: [[s["step"], s["num_seqs"], s["idle_slots"]]
                                                for s in run.steps()])  # fmt: skip
    assert sorted(label for label, _ in merged) == ["scheduler=a = scheduler=b", "scheduler=c"]


@pytest.mark.parametrize("spread", [False, True])
def test_the_workload_plot_words_an_offline_batch_and_draws_a_spread_rate(
    tmp_path, monkeypatch, spread
):
    """All arrivals at one instant have no rate to draw: the panel says so in words;
    arrivals spread over time are drawn as a rate line, with no such words."""
    from types import SimpleNamespace

    from servelab.lab import plots_workload

    rows = [
        {"prompt_tokens": 8 + i, "output_tokens": 4, "arrival_time": (i * 0.5 if spread else 0.0)}
        for i in range(6)
    ]
    run = SimpleNamespace(
        error=None, folder=tmp_path, results={"config": {"workload": {"name": "w"}}},
        requests=lambda: rows, swept={}, provenance={},
    )  # fmt: skip
    (tmp_path / "requests.csv").write_text("")
    figures = []
    monkeypatch.setattr(plots_workload, "save", lambda fig, path: figures.append(fig))
    assert plots_workload.plot_workloads([run], tmp_path / "workload.png")
    rate = figures[0].axes[2]
    words = [t.get_text() for t in rate.texts]
    if spread:
        assert words == [] and len(rate.lines) == 1
    else:
        assert words == ["all 6 requests arrive at once\n(an offline batch)"] and not rate.lines


def drawn_labels(fig, ax, which: str = "x") -> list:
    """The tick labels `ax` shows once drawn: (text, its box on the canvas), left to right."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    axis = ax.xaxis if which == "x" else ax.yaxis
    low, high = sorted(axis.get_view_interval())
    return [(t.get_text(), t.get_window_extent(renderer))
            for t, tick in zip(axis.get_ticklabels(), axis.get_ticklocs())
            if t.get_text() and t.get_visible() and low <= tick <= high]  # fmt: skip


def test_claim_ratio_tick_labels_never_overlap(monkeypatch, tmp_path):
    """The prefix-caching preset's claim (bound 0.3, an exact 0.224) on its long row labels:
    the bound's label sat on 0.25's ("0.20.3") and 1's on 1.25's ("11.25")."""
    from servelab.lab import plots_claims

    figures = []
    monkeypatch.setattr(plots_claims, "save", lambda fig, path: figures.append(fig))
    label = "allocator.prefix_caching=true vs allocator.prefix_caching=false"
    claims = [
        type("C", (), {"bars": [(label, Estimate(0.224, 0.0, 0.224, 0.224, 5, exact=True))],
                       "text": "prefix caching cuts the prompt tokens computed to at most 0.3",
                       "figure": "prefill_tokens", "op": "ratio_at_most", "bound": 0.3,
                       "verdict": "holds"}),
        type("C", (), {"bars": [(label, Estimate(0.613, 0.1, 0.49, 0.76, 5))],
                       "text": "time to first token falls", "figure": "ttft_mean_ms",
                       "op": "ratio_below", "bound": 1.0, "verdict": "holds"}),
    ]  # fmt: skip
    assert plots_claims.plot_claims(claims, tmp_path / "claims.png")
    fig = figures[0]
    for ax in fig.axes:
        labels = drawn_labels(fig, ax)
        texts = [text for text, _ in labels]
        assert len(texts) >= 3 and "1" in texts, texts
        for (a, box_a), (b, box_b) in zip(labels, labels[1:]):
            assert box_a.x1 + 2 < box_b.x0, f"{a!r} and {b!r} overlap"
    assert "0.3" in [text for text, _ in drawn_labels(fig, fig.axes[0])]  # the bound is ticked


@pytest.mark.parametrize("low,high", [(0.6, 12.0), (0.5, 3.2), (15.0, 220.0), (1.0, 1e4),
                                      (0.9, 1.3), (1e-3, 1e6)])  # fmt: skip
def test_log_axes_label_between_three_and_nine_ticks_in_plain_numbers(low, high):
    from servelab.lab.plots import log_axis, pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot([low, high], [0, 1])
    log_axis(ax, "x")
    labels = drawn_labels(fig, ax)
    plt.close(fig)
    texts = [text for text, _ in labels]
    assert 3 <= len(texts) <= 9, texts
    assert all("e" not in t and not t.endswith(".0") for t in texts), texts
    for (a, box_a), (b, box_b) in zip(labels, labels[1:]):
        assert box_a.x1 < box_b.x0, f"{a!r} and {b!r} overlap"
