"""The report's statistics against values computed independently: scipy's t
interval and a t-table value, a bootstrap written out here with its own
generator, a coverage check on synthetic data, and the three verdicts."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from servelab.lab.stats import (
    FAILS,
    HOLDS,
    INCONCLUSIVE,
    INDICATIVE,
    Estimate,
    interval_text,
    is_counted,
    mean_estimate,
    percentile_estimate,
    ratio_estimate,
    rounded,
    verdict,
)


def test_mean_interval_is_students_t():
    values = [10.0, 12.0, 11.0, 13.0, 9.0]
    got = mean_estimate(values)
    # by hand: mean 11, s = sqrt(2.5), t(0.975, 4) = 2.776 (a t table)
    half = 2.776 * math.sqrt(2.5) / math.sqrt(5)
    assert got.mean == 11 and got.std == pytest.approx(math.sqrt(2.5))
    assert (got.low, got.high) == pytest.approx((11 - half, 11 + half), abs=1e-3)
    low, high = stats.t.interval(0.95, 4, loc=11, scale=stats.sem(values))
    assert (got.low, got.high) == pytest.approx((low, high))


def test_one_run_has_no_interval_unless_counted():
    assert mean_estimate([5.0]).low == -math.inf and mean_estimate([5.0]).high == math.inf
    exact = mean_estimate([7, 7, 7], counted=True)
    assert exact.exact and (exact.low, exact.high) == (7, 7)
    assert mean_estimate([7], counted=True).exact
    assert not mean_estimate([7, 8], counted=True).exact  # counted, but the runs disagree
    assert math.isnan(mean_estimate([]).mean) and math.isnan(mean_estimate([None]).mean)


def hand_bootstrap_ratio(a, b, resamples, seed):
    """A percentile bootstrap of mean(a) / mean(b), each side resampled on its own."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(a), np.asarray(b)
    draws = [rng.choice(a, a.size).mean() / rng.choice(b, b.size).mean() for _ in range(resamples)]
    return np.quantile(draws, [0.025, 0.975])


def test_a_ratio_is_welchs_interval_on_the_log_scale():
    rng = np.random.default_rng(1)
    a, b = rng.normal(200, 10, 8), rng.normal(100, 8, 8)
    got = ratio_estimate(a, b)
    # independently: scipy's Welch t test of the logs, its interval exponentiated
    ci = stats.ttest_ind(np.log(a), np.log(b), equal_var=False).confidence_interval(0.95)
    assert got.mean == pytest.approx(math.exp(np.log(a).mean() - np.log(b).mean()))
    assert (got.low, got.high) == pytest.approx((math.exp(ci.low), math.exp(ci.high)))
    assert got.n == 8 and ratio_estimate(a, b) == got


def test_ratio_intervals_are_positive_and_symmetric_in_fold_change():
    # two wildly different repeats: a linear interval would reach below zero
    up = ratio_estimate([1.2, 2.4, 1.0], [1.0, 1.0, 1.0], paired=True)
    assert 0 < up.low < up.mean < up.high
    down = ratio_estimate([1.0, 1.0, 1.0], [1.2, 2.4, 1.0], paired=True)
    # b over a is the reciprocal of a over b, interval and all
    assert (down.low, down.mean, down.high) == pytest.approx((1 / up.high, 1 / up.mean, 1 / up.low))
    # symmetric on the log scale: as many fold-changes below the estimate as above it
    assert up.mean / up.low == pytest.approx(up.high / up.mean)


def test_a_ratio_with_zeros_falls_back_to_a_bootstrap_of_means():
    rng = np.random.default_rng(1)
    a, b = rng.normal(200, 10, 8), np.array([0, 100, 90, 110, 95, 105, 101, 98.0])
    got = ratio_estimate(a, b)
    low, high = hand_bootstrap_ratio(a, b, 20_000, seed=2)
    assert got.mean == pytest.approx(a.mean() / b.mean())
    # two bootstraps with different draws agree to their Monte Carlo error
    assert got.low == pytest.approx(low, rel=0.03) and got.high == pytest.approx(high, rel=0.03)


def test_exact_and_undecidable_ratios():
    exact = ratio_estimate([300, 300], [600, 600], counted=True)
    assert exact.exact and (exact.low, exact.mean, exact.high) == (0.5, 0.5, 0.5)
    one = ratio_estimate([3.0], [1.5])
    assert one.mean == 2.0 and one.low == -math.inf
    assert math.isnan(ratio_estimate([1.0, 2.0], [0.0, 0.0]).mean)


def test_intervals_of_positive_figures_never_cross_zero():
    # "689 ± 1,884 tok/s": two repeats far apart; a throughput cannot be negative
    got = mean_estimate([120.0, 1258.0])
    t_high = stats.t.interval(0.95, 1, loc=689, scale=stats.sem([120.0, 1258.0]))[1]
    assert got.low == 0 and got.high == pytest.approx(t_high)
    assert rounded(got).startswith("689 [0, ")  # shown as the interval, not mean ± half-width
    # a figure that can be negative keeps its whole t interval
    assert mean_estimate([-50.0, 60.0]).low < -50


def test_a_timed_figure_on_too_few_repeats_is_indicative():
    two = Estimate(2.0, 0.05, 1.96, 2.07, 2)
    assert verdict(two, "ratio_at_least", 1.2, min_repeats=5) == INDICATIVE
    assert verdict(two, "ratio_at_least", 1.2, min_repeats=2) == HOLDS
    five = Estimate(2.0, 0.05, 1.96, 2.07, 5)
    assert verdict(five, "ratio_at_least", 1.2, min_repeats=5) == HOLDS
    exact = Estimate(0.4, 0.0, 0.4, 0.4, 1, exact=True)  # counted: one run decides
    assert verdict(exact, "ratio_at_most", 0.5, min_repeats=5) == HOLDS


def test_percentile_interval_of_one_run_matches_scipys_bootstrap():
    rng = np.random.default_rng(3)
    values = rng.lognormal(3, 0.5, 400)
    got = percentile_estimate([values], 90)
    reference = stats.bootstrap(
        (values,), lambda x, axis: np.percentile(x, 90, axis=axis), method="percentile",
        n_resamples=20_000, random_state=np.random.default_rng(4),
    ).confidence_interval  # fmt: skip
    assert got.mean == pytest.approx(np.percentile(values, 90))
    assert got.low == pytest.approx(reference.low, rel=0.03)
    assert got.high == pytest.approx(reference.high, rel=0.03)


def test_two_level_percentile_interval_covers_the_truth():
    # runs whose level shifts from run to run (a busy machine): the interval must cover
    # the true p50 of the mixture about 95% of the time, so between-run spread counts
    rng = np.random.default_rng(5)
    covered = 0
    trials = 60
    for _ in range(trials):
        shifts = rng.normal(0, 1.0, 4)
        runs = [rng.normal(10 + s, 1.0, 50) for s in shifts]
        got = percentile_estimate(runs, 50, seed=int(rng.integers(1 << 30)))
        covered += got.low <= 10 <= got.high
    assert covered / trials >= 0.8
    # the within-run-only interval (one pooled run) is far narrower: it ignores the shifts
    pooled = percentile_estimate([np.concatenate(runs)], 50)
    assert pooled.half_width < got.half_width


def test_runs_of_different_sizes_take_the_same_statistic():
    rng = np.random.default_rng(6)
    runs = [rng.normal(5, 1, 30), rng.normal(5, 1, 45)]
    got = percentile_estimate(runs, 99)
    assert got.mean == pytest.approx(np.percentile(np.concatenate(runs), 99))
    assert got.low < got.mean < got.high and got.n == 2


@pytest.mark.parametrize(
    "low, high, op, bound, expected",
    [
        (2.1, 2.5, "ratio_at_least", 2.0, HOLDS),
        (1.5, 1.9, "ratio_at_least", 2.0, FAILS),
        (1.9, 2.1, "ratio_at_least", 2.0, INCONCLUSIVE),
        (2.0, 2.0, "ratio_at_least", 2.0, HOLDS),  # an exact value on the bound meets it
        (0.3, 0.45, "ratio_at_most", 0.5, HOLDS),
        (0.55, 0.7, "ratio_at_most", 0.5, FAILS),
        (0.45, 0.55, "ratio_at_most", 0.5, INCONCLUSIVE),
        (0.8, 0.99, "ratio_below", 1.0, HOLDS),
        (1.0, 1.0, "ratio_below", 1.0, FAILS),
        (11, 20, "at_least", 10, HOLDS),
        (2, 9, "at_least", 10, FAILS),
        (5, 15, "at_most", 10, INCONCLUSIVE),
        (-math.inf, math.inf, "at_least", 10, INCONCLUSIVE),  # one timed run
        (math.nan, math.nan, "at_least", 10, INCONCLUSIVE),
    ],
)
def test_the_three_verdicts(low, high, op, bound, expected):
    assert verdict(Estimate((low + high) / 2, 0.0, low, high, 3), op, bound) == expected


def test_counted_and_timed_figures():
    for name in ("steps", "prefill_tokens", "preemptions", "swapped_out_bytes", "kv_util_pct",
                 "prefix_hit_rate", "idle_slot_pct", "longest_stall_steps"):  # fmt: skip
        assert is_counted(name), name
    for name in ("output_tok_s", "ttft_p99_ms", "step_ms_mean", "wall_time_s",
                 "request_throughput", "goodput_rps", "slo_attainment_pct"):  # fmt: skip
        assert not is_counted(name), name


def test_numbers_are_rounded_to_their_interval():
    assert rounded(Estimate(1234.5678, 1.0, 1234.5678 - 35, 1234.5678 + 35, 3)) == "1,235 ± 35"
    assert rounded(Estimate(0.123456, 0.0, 0.123456 - 0.0035, 0.123456 + 0.0035, 3)) == (
        "0.1235 ± 0.0035"
    )
    # an interval that is not mean ± half-width (cut at zero, a ratio's) is shown as it is
    assert rounded(Estimate(1234.5678, 1.0, 1200.0, 1270.0, 3)) == "1,235 [1,200, 1,270]"
    assert rounded(Estimate(512, 0, 512, 512, 3, exact=True)) == "512"
    assert interval_text(Estimate(2.0, 0.1, 1.9, 2.1, 3)) == "[1.90, 2.10]"
    assert "one run" in interval_text(Estimate(2.0, math.nan, -math.inf, math.inf, 1))


def test_a_paired_ratio_is_the_paired_t_interval_of_the_log_ratios():
    # a busy spell slows both sides of a repeat alike: pairing cancels it
    rng = np.random.default_rng(7)
    load = rng.uniform(0.5, 1.5, 10)  # each repeat's machine speed
    a, b = 300 * load * rng.normal(1, 0.01, 10), 100 * load * rng.normal(1, 0.01, 10)
    paired, independent = ratio_estimate(a, b, paired=True), ratio_estimate(a, b)
    assert paired.mean == pytest.approx(independent.mean) == pytest.approx(
        math.exp(np.mean(np.log(a / b)))
    )
    assert paired.low < 3.0 < paired.high
    assert paired.half_width < independent.half_width / 5
    # independently: scipy's paired t test of the logs
    ci = stats.ttest_rel(np.log(a), np.log(b)).confidence_interval(0.95)
    assert (paired.low, paired.high) == pytest.approx((math.exp(ci.low), math.exp(ci.high)))


def test_large_samples_take_the_counted_bootstrap_with_the_same_interval(monkeypatch):
    # per-token latencies: thousands of values a run. The counted draws (a normal count
    # of resampled values below x, inverted) must match drawing every value
    from servelab.lab import stats as module

    rng = np.random.default_rng(9)
    runs = [rng.lognormal(3 + 0.1 * rng.normal(), 0.5, 1500) for _ in range(4)]
    for q in (50, 90):
        assert module._counts_suffice(runs, q)
        counted = percentile_estimate(runs, q)
        monkeypatch.setattr(module, "COUNTED_MIN_VALUES", 10**12)  # every value drawn
        drawn = percentile_estimate(runs, q)
        monkeypatch.undo()
        assert counted.mean == drawn.mean == pytest.approx(np.percentile(np.concatenate(runs), q))
        assert counted.low == pytest.approx(drawn.low, rel=0.01)
        assert counted.high == pytest.approx(drawn.high, rel=0.01)
    assert not module._counts_suffice(runs, 99.9)  # 6 values past the percentile: drawn
