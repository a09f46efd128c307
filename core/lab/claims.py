"""A preset's claims, evaluated against its runs. A claim names a figure, the
runs it is about and a bound, absolute or relative to other runs; a claim over
a sweep with more keys than it names is stated once per matching pair, so
every comparison the sweep holds is checked, not only the first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from servelab.errors import ConfigError
from servelab.lab.runs import Run, figure, fmt, normalize

CLAIM_OPS = {
    "ratio_at_least": (True, lambda r, x: r >= x, "≥ {x:g}×"),
    "ratio_at_most": (True, lambda r, x: r <= x, "≤ {x:g}×"),
    "ratio_below": (True, lambda r, x: r < x, "< {x:g}×"),
    "at_least": (False, lambda v, x: v >= x, "≥ {x:g}"),
    "at_most": (False, lambda v, x: v <= x, "≤ {x:g}"),
}


@dataclass
class ClaimResult:
    text: str
    holds: bool | None  # None: the runs it names are missing


def evaluate_claims(runs: Sequence[Run], claims: Iterable[Mapping]) -> list[ClaimResult]:
    return [result for claim in claims for result in evaluate_claim(runs, claim)]


def parse_selector(selector: str) -> dict[str, str]:
    """`"scheduler=static attention=padded"` -> {scheduler: static, attention: padded}."""
    pairs = {}
    for part in str(selector).split():
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ConfigError(f"report claim: a run is selected by key=value, got {selector!r}")
        pairs[key] = normalize(value)
    if not pairs:
        raise ConfigError("report claim: an empty run selector")
    return pairs


def matches(run: Run, selector: dict[str, str]) -> bool:
    return all(run.params.get(k) == v for k, v in selector.items())


def evaluate_claim(runs: Sequence[Run], claim: Mapping) -> list[ClaimResult]:
    """A claim names a figure, the runs it is about (`run`: space-separated
    `key=value`s), optionally the runs to compare with (`vs`), and one of
    CLAIM_OPS; or a figure and `same_in_every_run: true`. Where several runs
    match (a sweep over more keys), each is paired with the `vs` run that has
    the same values of the other swept keys, and each pair is stated."""
    claim = dict(claim)
    name, text = claim.pop("figure", None), claim.pop("text", None)
    if claim.pop("same_in_every_run", False):
        values = {str(run.summary.get(name)) for run in runs}
        shown = ", ".join(sorted(values))
        return [
            ClaimResult(
                f"{text or name + ' is the same in every run'} — {name}: {shown}",
                len(values) == 1 and "None" not in values,
            )
        ]
    run_sel, vs_sel = claim.pop("run", None), claim.pop("vs", None)
    ops = [op for op in claim if op in CLAIM_OPS]
    unknown = [k for k in claim if k not in CLAIM_OPS]
    if not name or not run_sel or len(ops) != 1 or unknown:
        raise ConfigError(
            f"report claim {claim!r}: needs figure, run (key=value), optional vs and text, "
            f"and exactly one of {', '.join(CLAIM_OPS)} (or figure + same_in_every_run: true)"
        )
    op = ops[0]
    is_ratio, test, shown = CLAIM_OPS[op]
    if is_ratio and not vs_sel:
        raise ConfigError(f"report claim on {name}: {op} compares two runs; give `vs`")
    bound = float(claim[op])
    run_pairs = parse_selector(run_sel)
    picked = [r for r in runs if matches(r, run_pairs)]
    heading = text or f"{name} of {run_sel}"
    if not picked:
        return [ClaimResult(f"{heading} — no run with {run_sel}", None)]
    results = []
    for run in picked:
        value = figure(run, name)
        if not is_ratio:
            holds = test(value, bound) if not math.isnan(value) else False
            detail = f"{name} = {fmt(value)} ({run.label}) [claim {shown.format(x=bound)}]"
            results.append(ClaimResult(f"{heading} — {detail}", holds))
            continue
        vs_pairs = parse_selector(vs_sel)
        # pair with the run that differs only in what the two selectors name
        others = {k: v for k, v in run.swept.items() if k not in run_pairs and k not in vs_pairs}
        partners = [
            r
            for r in runs
            if matches(r, vs_pairs) and all(r.swept.get(k) == v for k, v in others.items())
        ]
        if not partners:
            results.append(ClaimResult(f"{heading} — no run with {vs_sel} to compare", None))
            continue
        base = figure(partners[0], name)
        ratio = value / base if base else math.inf if value > 0 else math.nan
        holds = test(ratio, bound) if not math.isnan(ratio) else False
        where = f" at {', '.join(f'{k}={v}' for k, v in others.items())}" if others else ""
        detail = (
            f"{name}: {fmt(value)} ({run_sel}) vs {fmt(base)} ({vs_sel}){where} = "
            f"{fmt(ratio)}× [claim {shown.format(x=bound)}]"
        )
        results.append(ClaimResult(f"{heading} — {detail}", holds))
    return results
