"""Runs timed by a virtual clock (executor=simulated) are deterministic: the
report decides their timed figures exactly from one repeat, while a wall-clock
run's timed figures stay estimates that need repeats."""

from __future__ import annotations

from pathlib import Path

from servelab.lab.estimates import estimate, ratio
from servelab.lab.runs import Configuration, Run


def config(tok_s: float, steps: int, virtual: bool, name: str) -> Configuration:
    results = {
        "summary": {"output_tok_s": tok_s, "steps": steps, "ttft_p99_ms": 5.0},
        "provenance": {"executor": {"virtual_clock": virtual}},
    }
    run = Run(Path(f"/nonexistent/{name}"), results, {}, {"scheduler": name})
    return Configuration({"scheduler": name}, [run])


def test_a_virtual_clock_run_is_exact_from_one_repeat():
    fast, slow = config(200.0, 50, True, "a"), config(100.0, 100, True, "b")
    assert fast.deterministic
    tok_s = estimate(fast, "output_tok_s")
    assert tok_s.exact and tok_s.low == tok_s.high == 200.0
    # a percentile is the run's own figure, not a bootstrap over its requests
    assert estimate(fast, "ttft_p99_ms").exact
    assert ratio(fast, slow, "output_tok_s").exact
    assert ratio(fast, slow, "output_tok_s").mean == 2.0


def test_a_wall_clock_run_needs_repeats_for_timed_figures():
    fast, slow = config(200.0, 50, False, "a"), config(100.0, 100, False, "b")
    assert not fast.deterministic
    assert not estimate(fast, "output_tok_s").exact
    assert not ratio(fast, slow, "output_tok_s").exact
    assert estimate(fast, "steps").exact  # a count is exact either way


def test_one_wall_clock_side_makes_a_ratio_an_estimate():
    simulated, real = config(200.0, 50, True, "a"), config(100.0, 100, False, "b")
    assert not ratio(simulated, real, "output_tok_s").exact
