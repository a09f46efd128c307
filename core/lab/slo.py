"""Service-level objectives: which requests met them, goodput, and a
configuration's capacity over a rate sweep.

`report.slo` sets per-request targets (any of `ttft_ms`, `tpot_ms`, `itl_ms`)
and `percentile`, the share of requests that must meet them. A request meets
the SLO when it completed, its time to first token is at most `ttft_ms`, its
time per output token at most `tpot_ms`, and every gap between its tokens at
most `itl_ms`. Per run: `slo_attainment_pct` (of every request, unfinished ones
count as misses) and `goodput_rps`, requests meeting the SLO per second
(DistServe's goodput, per run). A rate sweep's capacity is the highest
`workload.rate` whose mean attainment reaches `percentile`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

from servelab.errors import ConfigError
from servelab.lab.runs import Configuration, Run
from servelab.registry.typed import check_value
from servelab.step.sequence import finite_number

TARGETS = ("ttft_ms", "tpot_ms", "itl_ms")
SLO_KEYS = (*TARGETS, "percentile")
# the typed `report.slo` node (lab/config_schema.py): every key unset is no SLO
SLO_DEFAULTS: dict = dict.fromkeys(SLO_KEYS)
SLO_TYPES = dict.fromkeys(SLO_KEYS, float | None)
DEFAULT_PERCENTILE = 90.0
RATE_KEY = "workload.rate"


def slo_options(node: Mapping | None) -> dict | None:
    """The checked `report.slo` node; None (no SLO) when it sets no key."""
    if node is None:
        return None
    if not isinstance(node, Mapping):
        raise ConfigError(f"report option slo must be a mapping of {', '.join(SLO_KEYS)}")
    unknown = [k for k in node if k not in SLO_KEYS]
    if unknown:
        raise ConfigError(f"unknown report.slo key {unknown[0]!r}; accepted: {', '.join(SLO_KEYS)}")
    given = {k: v for k, v in node.items() if v is not None}
    if not given:
        return None
    options = {"percentile": DEFAULT_PERCENTILE, **given}
    for key, value in options.items():
        check_value(f"report.slo.{key}", value, float)
        if not (finite_number(value) or 0) > 0:
            raise ConfigError(f"report.slo.{key} must be > 0, got {value!r}")
    if options["percentile"] > 100:
        raise ConfigError(f"report.slo.percentile must be at most 100, got {options['percentile']}")
    if not any(k in options for k in TARGETS):
        raise ConfigError(f"report.slo needs at least one target of {', '.join(TARGETS)}")
    return options


def meets(row: Mapping, slo: Mapping) -> bool:
    """Whether one requests.csv row met every target of `slo`."""
    if row.get("finish_reason") not in ("stop", "length"):
        return False
    if "ttft_ms" in slo and not _within(row.get("ttft"), slo["ttft_ms"]):
        return False
    if "tpot_ms" in slo and row.get("tpot") is not None:  # one token: no time per token
        if not _within(row["tpot"], slo["tpot_ms"]):
            return False
    if "itl_ms" in slo:
        times = json.loads(row.get("token_times") or "[]")
        if any(1000.0 * (b - a) > slo["itl_ms"] for a, b in zip(times, times[1:])):
            return False
    return True


def _within(seconds, target_ms: float) -> bool:
    return seconds is not None and 1000.0 * float(seconds) <= target_ms


def add_slo_figures(runs: Sequence[Run], slo: Mapping | None) -> None:
    """Adds `slo_attainment_pct` and `goodput_rps` to each finished run's summary."""
    if not slo:
        return
    for run in runs:
        if run.error:
            continue
        rows = run.requests()
        met = sum(meets(row, slo) for row in rows)
        wall = run.summary.get("wall_time_s") or 0.0
        run.summary["slo_attainment_pct"] = 100.0 * met / len(rows) if rows else math.nan
        run.summary["goodput_rps"] = met / wall if wall else math.nan


def capacity(configs: Sequence[Configuration], slo: Mapping) -> list[dict]:
    """Per configuration family (the swept choices but the rate): the highest
    swept rate whose mean SLO attainment reaches the percentile, and each rate's
    attainment. Empty when the rate is not swept."""
    families: dict[tuple, dict[float, float]] = {}
    for config in configs:
        if RATE_KEY not in config.swept or not config.finished:
            continue
        family = tuple((k, v) for k, v in config.swept.items() if k != RATE_KEY)
        values = [v for v in config.values("slo_attainment_pct") if not math.isnan(v)]
        if values:
            families.setdefault(family, {})[float(config.swept[RATE_KEY])] = sum(values) / len(
                values
            )
    rows = []
    for family, by_rate in families.items():
        meeting = [rate for rate, pct in by_rate.items() if pct >= slo["percentile"]]
        rows.append(
            {
                "configuration": ", ".join(f"{k}={v}" for k, v in family) or "every run",
                "capacity_rps": max(meeting) if meeting else None,
                "attainment_by_rate": dict(sorted(by_rate.items())),
            }
        )
    return rows
