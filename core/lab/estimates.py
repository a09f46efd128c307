"""A configuration's figures as estimates over its repeats (see lab/stats.py):
which statistic each figure takes, and the per-request samples a percentile
is bootstrapped from."""

from __future__ import annotations

import json
import re
from functools import lru_cache

from servelab.lab.runs import Configuration, Run, figure
from servelab.lab.stats import (
    Estimate,
    is_counted,
    mean_estimate,
    percentile_estimate,
    ratio_estimate,
)

# `ttft_p99_ms`: the 99th percentile of a per-request (or per-token) latency
PERCENTILE_FIGURE = re.compile(r"^(ttft|tpot|itl|e2e|queue)_p(\d+)_ms$")
COMPLETED = ("stop", "length")


def latency_samples(run: Run, kind: str) -> list[float]:
    """One run's latencies in ms: per request (`ttft`, `tpot`, `e2e`, `queue`)
    or per token (`itl`), of the requests that completed."""
    return list(_samples(run.folder, kind))


@lru_cache(maxsize=512)
def _samples(folder, kind: str) -> tuple[float, ...]:
    column = {"queue": "queue_time"}.get(kind, kind)
    out: list[float] = []
    for row in Run(folder, {}, {}).requests():
        if row.get("finish_reason") not in COMPLETED:
            continue
        if kind == "itl":
            times = json.loads(row.get("token_times") or "[]")
            out += [1000.0 * (b - a) for a, b in zip(times, times[1:])]
        elif row.get(column) is not None:
            out.append(1000.0 * float(row[column]))
    return tuple(out)


def estimate(config: Configuration, name: str) -> Estimate:
    """The figure `name` of `config` over its finished repeats (computed once)."""
    if name not in config.estimates:
        config.estimates[name] = _estimate(config, name)
    return config.estimates[name]


def _estimate(config: Configuration, name: str) -> Estimate:
    match = PERCENTILE_FIGURE.match(name)
    if match and not config.deterministic:
        kind, q = match.group(1), float(match.group(2))
        samples = [latency_samples(run, kind) for run in config.finished]
        if any(samples):
            return percentile_estimate(samples, q)
    return mean_estimate(config.values(name), counted=counted(config, name))


def counted(config: Configuration, name: str) -> bool:
    """Whether `name` is exact over `config`'s runs: a count, or any figure of a
    virtual-clock run (the same config gives the same times)."""
    return is_counted(name) or config.deterministic


def paired_repeats(config: Configuration, baseline: Configuration) -> bool:
    """Whether both ran the same repeats (an interleaved sweep): repeat i of one
    then ran beside repeat i of the other."""
    mine = {run.repeat for run in config.finished}
    theirs = {run.repeat for run in baseline.finished}
    return len(mine) == len(config.finished) == len(baseline.finished) > 1 and mine == theirs


def ratio(config: Configuration, baseline: Configuration, name: str) -> Estimate:
    """config's figure over baseline's (lab/stats.py's ratio_estimate), paired
    where both ran the same repeats."""
    mine = {run.repeat: figure(run, name) for run in config.finished}
    theirs = {run.repeat: figure(run, name) for run in baseline.finished}
    exact = counted(config, name) and counted(baseline, name)
    if paired_repeats(config, baseline):
        order = sorted(mine)
        return ratio_estimate([mine[i] for i in order], [theirs[i] for i in order],
                              counted=exact, paired=True)  # fmt: skip
    return ratio_estimate(config.values(name), baseline.values(name), counted=exact)
