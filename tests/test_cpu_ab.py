"""`benchmarks/cpu_ab.py`, without timing anything: a tree's mapped copy imports
as `servelab` ahead of the installed package, runs alternate A B B A with the
warm-ups first, B/A pairs each round's means, and differing token digests or a
run that was not pinned fail the comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


def test_a_mapped_copy_imports_ahead_of_the_installed_package(tmp_path):
    cpu_ab = load_benchmark("cpu_ab")
    site = cpu_ab.mapped_copy(ROOT, tmp_path / "site")
    probe = "import servelab, servelab.plugins.attention, servelab.conf; print(servelab.__file__)"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env=dict(os.environ, PYTHONPATH=str(site)),
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert Path(done.stdout.strip()).resolve() == (site / "servelab" / "__init__.py").resolve()


def fake_runs(monkeypatch, cpu_ab, rates: dict[str, list[float]], digests=None, cpus=(0,)):
    """run_side replaced: each side's runs take `rates[side]` in turn; returns the
    order the sides ran in."""
    order: list[str] = []
    taken = {"A": 0, "B": 0}

    def run_side(args, side, tree, site):
        order.append(side)
        i = taken[side]
        taken[side] += 1
        return dict(
            side=side,
            output_tok_s=rates[side][i],
            wall_s=1.0,
            output_tokens=100,
            requests=4,
            digest=(digests or {}).get(side, "same"),
            threads=1,
            cpus=list(cpus),
        )

    monkeypatch.setattr(cpu_ab, "run_side", run_side)
    return order


def test_runs_alternate_and_the_ratio_pairs_each_rounds_means(monkeypatch, tmp_path, capsys):
    cpu_ab = load_benchmark("cpu_ab")
    # the first run of each side is the untimed warm-up
    rates = {"A": [1.0, 100, 102, 90, 94], "B": [1.0, 110, 114, 99, 101]}
    order = fake_runs(monkeypatch, cpu_ab, rates)
    out = tmp_path / "ab.json"
    args = ["--before", str(ROOT), "--core", "0", "--repeats", "2", "--json", str(out)]
    assert cpu_ab.main(args) == 0
    assert order == ["A", "B"] + ["A", "B", "B", "A"] * 2
    report = json.loads(out.read_text())
    assert [r["side"] for r in report["runs"]] == ["A", "B", "B", "A"] * 2
    assert report["sides"]["A"]["mean"] == pytest.approx((100 + 102 + 90 + 94) / 4)
    # rounds: A (100+102)/2, (90+94)/2; B (110+114)/2, (99+101)/2; the paired ratio is
    # estimated on the log scale: the geometric mean of the rounds' ratios
    assert report["ratio"]["mean"] == pytest.approx(((112 / 101) * (100 / 92)) ** 0.5)
    assert report["ratio"]["low"] <= report["ratio"]["mean"] <= report["ratio"]["high"]
    assert "token digests: identical" in capsys.readouterr().out


def test_differing_digests_fail(monkeypatch, capsys):
    cpu_ab = load_benchmark("cpu_ab")
    rates = {"A": [1.0] * 5, "B": [1.0] * 5}
    fake_runs(monkeypatch, cpu_ab, rates, digests={"A": "aaa", "B": "bbb"})
    assert cpu_ab.main(["--before", str(ROOT), "--core", "0", "--repeats", "2"]) == 1
    assert "DIFFER" in capsys.readouterr().out


def test_a_run_on_another_core_fails(monkeypatch):
    cpu_ab = load_benchmark("cpu_ab")
    rates = {"A": [1.0] * 3, "B": [1.0] * 3}
    fake_runs(monkeypatch, cpu_ab, rates, cpus=(0, 1))
    with pytest.raises(SystemExit, match="not pinned"):
        cpu_ab.main(["--before", str(ROOT), "--core", "0", "--repeats", "1"])


def test_a_tree_without_the_source_folders_is_refused(tmp_path):
    cpu_ab = load_benchmark("cpu_ab")
    with pytest.raises(SystemExit, match="not a servelab tree"):
        cpu_ab.mapped_copy(tmp_path, tmp_path / "site")


def test_overhead_ab_runs_each_tree_a_b_b_a_and_prints_each_case(tmp_path, capsys):
    """`benchmarks/overhead_ab.py` on this tree twice (smoke size): four pinned runs
    of the scheduler-overhead benchmark, one line per case with both sides and B/A."""
    load_benchmark("cpu_ab")  # overhead_ab imports it as a sibling script
    overhead_ab = load_benchmark("overhead_ab")
    code = overhead_ab.main(
        ["--before", str(ROOT), "--after", str(ROOT), "--core", "0", "--repeats", "1",
         "--smoke", "-k", "continuous and contiguous"]  # fmt: skip
    )
    out = capsys.readouterr().out
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith("continuous-contiguous:")]
    assert len(lines) == 1 and "us/step, B/A" in lines[0] and "(2 runs a side)" in lines[0]
