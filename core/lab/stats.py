"""The statistics behind a report: a figure over repeated runs is an estimate
with a 95% confidence interval, and a claim is decided on the interval.

- a mean over runs: Student's t interval (scipy.stats.t), cut at zero for a
  figure that cannot be negative (a truncated interval keeps its coverage);
- a percentile over requests (`ttft_p99_ms`): a two-level bootstrap that
  resamples the runs, then the requests within each, so the spread between runs
  (a busy machine) counts as well as the spread between requests;
- a ratio of two configurations: on the log scale, a t interval of the mean
  log ratio (paired where the repeats ran side by side, else Welch's), so the
  interval is positive and symmetric in fold-change (x2 and /2 alike).

Counted figures (steps, tokens, bytes, preemptions, prefix hits) do not depend
on the machine: where every run agrees the estimate is exact, [v, v].
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0  # a report is reproducible: the same runs give the same intervals
# figures measured on a clock; every other figure counts something the engine decided
TIMED_UNITS = re.compile(r"(_ms|_s|_throughput|_rps)(_|$)")  # ttft_p99_ms, step_ms_mean, tok_s
TIMED_NAMES = frozenset({"slo_attainment_pct"})


def is_counted(name: str) -> bool:
    """Whether a figure counts decisions (machine-independent) rather than time."""
    return not (TIMED_UNITS.search(name) or name in TIMED_NAMES)


@dataclass(frozen=True)
class Estimate:
    """A figure over `n` runs: its mean, standard deviation and 95% interval.
    `exact`: counted, and every run gave the same value."""

    mean: float
    std: float
    low: float
    high: float
    n: int
    exact: bool = False

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


NO_ESTIMATE = Estimate(math.nan, math.nan, math.nan, math.nan, 0)


def _finite(values: Sequence[float]) -> np.ndarray:
    array = np.asarray([v for v in values if v is not None], dtype=float)
    return array[np.isfinite(array)]


def mean_estimate(values: Sequence[float], counted: bool = False) -> Estimate:
    """The mean of per-run values with Student's t interval; one run has no
    interval (-inf, inf) unless the figure is counted."""
    x = _finite(values)
    if x.size == 0:
        return NO_ESTIMATE
    mean = float(x.mean())
    if np.all(x == x[0]) and (counted or x.size > 1):
        # no spread: t's interval would be [v, v] too, but scipy returns NaN for scale 0
        return Estimate(mean, 0.0, mean, mean, int(x.size), exact=counted)
    if x.size == 1:
        return Estimate(mean, math.nan, -math.inf, math.inf, 1)
    std = float(x.std(ddof=1))
    low, high = stats.t.interval(CONFIDENCE, x.size - 1, loc=mean, scale=std / math.sqrt(x.size))
    if np.all(x >= 0):  # a figure positive by nature: its mean cannot be below zero
        low = max(float(low), 0.0)
    return Estimate(mean, std, float(low), float(high), int(x.size))


def percentile_estimate(
    per_run: Sequence[Sequence[float]], q: float, seed: int = BOOTSTRAP_SEED
) -> Estimate:
    """The q-th percentile of the requests of all runs, with a two-level
    bootstrap interval: resample runs, then requests within each run."""
    runs = [_finite(values) for values in per_run]
    runs = [r for r in runs if r.size]
    if not runs:
        return NO_ESTIMATE
    point = float(np.percentile(np.concatenate(runs), q))
    per_run_points = [float(np.percentile(r, q)) for r in runs]
    std = float(np.std(per_run_points, ddof=1)) if len(runs) > 1 else math.nan
    rng = np.random.default_rng(seed)
    draws = _counted_draws(runs, q, rng) if _counts_suffice(runs, q) else _two_level_draws(runs, q, rng)
    alpha = (1 - CONFIDENCE) / 2
    low, high = np.quantile(draws, [alpha, 1 - alpha])
    return Estimate(point, std, float(low), float(high), len(runs))


# where the resampled values need not be drawn one by one (see _counted_draws)
COUNTED_MIN_VALUES = 5000  # values in a pooled resample
COUNTED_MIN_TAIL = 200  # values on the short side of the percentile


def _counts_suffice(runs: list[np.ndarray], q: float) -> bool:
    pooled = sum(r.size for r in runs)
    return pooled >= COUNTED_MIN_VALUES and min(q, 100 - q) / 100 * pooled >= COUNTED_MIN_TAIL


def _counted_draws(runs: list[np.ndarray], q: float, rng: np.random.Generator) -> np.ndarray:
    """The two-level bootstrap's percentiles without drawing each value (tens of
    thousands of per-token latencies, 2000 times, took most of a report).
    Within a picked run of m values, how many resampled values are <= x is
    Binomial(m, F_run(x)); summed over the picked runs it is normal to a
    fraction of a percent once both sides of the percentile hold >= 200 values.
    The resample's k-th smallest value is <= x exactly when that count is >= k,
    so one normal draw per resample, inverted by a binary search over the
    pooled values, gives the resample's percentile."""
    grid = np.unique(np.concatenate(runs))
    below = np.stack([np.searchsorted(np.sort(r), grid, side="right") / r.size for r in runs])
    sizes = np.array([r.size for r in runs], dtype=float)
    picked = rng.integers(0, len(runs), size=(BOOTSTRAP_RESAMPLES, len(runs)))
    m = sizes[picked]
    rank = np.rint(q / 100 * (m.sum(axis=1) - 1)) + 1  # the percentile's order statistic
    z = rng.standard_normal(BOOTSTRAP_RESAMPLES)
    low = np.zeros(BOOTSTRAP_RESAMPLES, dtype=int)
    high = np.full(BOOTSTRAP_RESAMPLES, grid.size - 1)
    while np.any(low < high):  # the first grid value whose count reaches the rank
        mid = (low + high) // 2
        f = below[picked, mid[:, None]]
        count = (m * f).sum(axis=1) + z * np.sqrt((m * f * (1 - f)).sum(axis=1))
        reached = count >= rank - 0.5
        high = np.where(reached, mid, high)
        low = np.where(reached, low, mid + 1)
    return grid[low]


def _two_level_draws(runs: list[np.ndarray], q: float, rng: np.random.Generator) -> np.ndarray:
    """BOOTSTRAP_RESAMPLES percentiles of two-level resamples (runs with
    replacement, then each picked run's values with replacement)."""
    sizes = {r.size for r in runs}
    if len(sizes) > 1:  # runs of different sizes: one resample at a time
        draws = np.empty(BOOTSTRAP_RESAMPLES)
        for b in range(BOOTSTRAP_RESAMPLES):
            picked = rng.integers(0, len(runs), size=len(runs))
            pooled = [runs[i][rng.integers(0, runs[i].size, size=runs[i].size)] for i in picked]
            draws[b] = np.percentile(np.concatenate(pooled), q)
        return draws
    # equal sizes (the usual case: one workload): whole blocks of resamples at once
    values, size, count = np.stack(runs), sizes.pop(), len(runs)
    chunk = max(1, min(BOOTSTRAP_RESAMPLES, 4_000_000 // (count * size)))
    out = []
    for start in range(0, BOOTSTRAP_RESAMPLES, chunk):
        n = min(chunk, BOOTSTRAP_RESAMPLES - start)
        picked = rng.integers(0, count, size=(n, count, 1))
        within = rng.integers(0, size, size=(n, count, size))
        out.append(np.percentile(values[picked, within].reshape(n, -1), q, axis=1))
    return np.concatenate(out)


def ratio_estimate(
    values: Sequence[float],
    baseline: Sequence[float],
    counted: bool = False,
    seed: int = BOOTSTRAP_SEED,
    paired: bool = False,
) -> Estimate:
    """values over baseline, estimated on the log scale: the ratio of their
    geometric means, with a t interval of the mean log ratio, exponentiated.
    `paired`: the i-th values ran beside each other (the same repeat of an
    interleaved sweep), so the interval is the one-sample t of the per-repeat
    log ratios and a busy spell that slowed both cancels out; otherwise Welch's
    interval of the difference of the two sides' mean logs. `n`: the pairs, or
    the smaller side. Fewer than two runs a side: no interval, unless both sides
    are exact. A side with a value <= 0 has no log: a bootstrap of the ratio of
    means (percentile method) decides instead."""
    if paired:
        pairs = [(x, y) for x, y in zip(values, baseline) if _finite([x, y]).size == 2]
        values, baseline = [x for x, _ in pairs], [y for _, y in pairs]
    a, b = _finite(values), _finite(baseline)
    if a.size == 0 or b.size == 0 or b.mean() == 0:
        return NO_ESTIMATE
    n = min(a.size, b.size)
    if counted and np.all(a == a[0]) and np.all(b == b[0]):
        ratio = float(a.mean() / b.mean())
        return Estimate(ratio, 0.0, ratio, ratio, n, exact=True)
    if np.any(a <= 0) or np.any(b <= 0):
        return _bootstrap_ratio(a, b, paired, seed)
    la, lb = np.log(a), np.log(b)
    if paired:
        diffs = la - lb
        centre, spread, df = diffs.mean(), diffs.std(ddof=1) if n > 1 else math.nan, n - 1
        scale = spread / math.sqrt(n)
    else:
        centre = la.mean() - lb.mean()
        va = la.var(ddof=1) / a.size if a.size > 1 else math.nan
        vb = lb.var(ddof=1) / b.size if b.size > 1 else math.nan
        scale = math.sqrt(va + vb)
        df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1)) if n > 1 else 0
    ratio = math.exp(centre)
    if n < 2:
        return Estimate(ratio, math.nan, -math.inf, math.inf, n)
    if scale == 0 or not math.isfinite(df):  # every repeat gave the same ratio
        return Estimate(ratio, 0.0, ratio, ratio, n)
    half = float(stats.t.ppf(0.5 + CONFIDENCE / 2, df)) * scale
    return Estimate(ratio, float(scale), math.exp(centre - half), math.exp(centre + half), n)


def _bootstrap_ratio(a: np.ndarray, b: np.ndarray, paired: bool, seed: int) -> Estimate:
    """mean(a) / mean(b) with a percentile bootstrap (repeats resampled together
    where paired): for figures that can be zero, where logs cannot go."""
    ratio, n = float(a.mean() / b.mean()), min(a.size, b.size)
    if n < 2:
        return Estimate(ratio, math.nan, -math.inf, math.inf, n)
    result = stats.bootstrap(
        (a, b),
        _ratio_of_means,
        vectorized=True,
        paired=paired,
        confidence_level=CONFIDENCE,
        n_resamples=BOOTSTRAP_RESAMPLES,
        method="percentile",
        random_state=np.random.default_rng(seed),
    )
    low, high = result.confidence_interval
    return Estimate(ratio, float(result.standard_error), float(low), float(high), n)


def _ratio_of_means(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(a, axis=axis) / np.mean(b, axis=axis)


# -- verdicts

HOLDS, FAILS, INCONCLUSIVE = "holds", "fails", "inconclusive"
# a timed claim on fewer repeats than `report.min_repeats`: shown, never decided. With two
# repeats a t interval has one degree of freedom and a bootstrap returns the range of two
# points; neither is a verdict a reviewer accepts.
INDICATIVE = "indicative"
MIN_REPEATS = 5

# op -> (compares two configurations, bound test on a whole interval)
VERDICT_RULES: dict[str, tuple[bool, Callable[[float, float, float], str]]] = {}


def _rule(is_ratio: bool, clears: Callable, misses: Callable):
    def decide(low: float, high: float, bound: float) -> str:
        if clears(low, high, bound):
            return HOLDS
        if misses(low, high, bound):
            return FAILS
        return INCONCLUSIVE

    return is_ratio, decide


for _name, _ratio in (("ratio_at_least", True), ("at_least", False)):
    VERDICT_RULES[_name] = _rule(_ratio, lambda lo, hi, x: lo >= x, lambda lo, hi, x: hi < x)
for _name, _ratio in (("ratio_at_most", True), ("at_most", False)):
    VERDICT_RULES[_name] = _rule(_ratio, lambda lo, hi, x: hi <= x, lambda lo, hi, x: lo > x)
VERDICT_RULES["ratio_below"] = _rule(True, lambda lo, hi, x: hi < x, lambda lo, hi, x: lo >= x)


def verdict(estimate: Estimate, op: str, bound: float, min_repeats: int = 1) -> str:
    """`holds` when the whole interval clears the bound, `fails` when the whole
    interval misses it, `inconclusive` when it straddles (or is missing);
    `indicative` when the estimate is not exact and rests on fewer than
    `min_repeats` repeats (the caller passes 1 for a figure that is exact)."""
    if not estimate.exact and 0 < estimate.n < min_repeats:
        return INDICATIVE
    if math.isnan(estimate.low) or math.isnan(estimate.high):
        return INCONCLUSIVE
    return VERDICT_RULES[op][1](estimate.low, estimate.high, bound)


def symmetric(estimate: Estimate) -> bool:
    """Whether the interval is mean ± half-width (a truncated or log-scale one is not)."""
    below, above = estimate.mean - estimate.low, estimate.high - estimate.mean
    return math.isclose(below, above, rel_tol=1e-6, abs_tol=1e-12 * max(1.0, abs(estimate.mean)))


def rounded(estimate: Estimate) -> str:
    """`mean ± half-width`, each rounded to what the interval supports (two
    significant digits of the half-width); an exact value as it is."""
    if math.isnan(estimate.mean):
        return "–"
    if estimate.exact or estimate.half_width == 0:
        return _plain(estimate.mean)
    if not math.isfinite(estimate.half_width):
        return f"{_plain(estimate.mean)} (1 run)"
    digits = max(0, 1 - math.floor(math.log10(estimate.half_width)))
    if not symmetric(estimate):  # cut at zero, or a ratio's log-scale interval
        return f"{estimate.mean:,.{digits}f} [{estimate.low:,.{digits}f}, {estimate.high:,.{digits}f}]"
    return f"{estimate.mean:,.{digits}f} ± {estimate.half_width:,.{digits}f}"


def point_text(estimate: Estimate) -> str:
    """The estimate alone, at the precision of its interval."""
    if math.isnan(estimate.mean):
        return "–"
    if estimate.exact or estimate.half_width == 0 or not math.isfinite(estimate.half_width):
        return _plain(estimate.mean)
    digits = max(0, 1 - math.floor(math.log10(estimate.half_width)))
    return f"{estimate.mean:,.{digits}f}"


def interval_text(estimate: Estimate) -> str:
    """`[low, high]` at the precision `rounded` uses."""
    if estimate.exact or estimate.half_width == 0:
        return f"[{_plain(estimate.low)}, {_plain(estimate.high)}] (exact)"
    if not math.isfinite(estimate.half_width):
        return "(no interval: one run)"
    digits = max(0, 1 - math.floor(math.log10(estimate.half_width)))
    return f"[{estimate.low:,.{digits}f}, {estimate.high:,.{digits}f}]"


def _plain(value: float) -> str:
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"
