"""A preset's claims, decided on its configurations' intervals. A claim names a
figure, the runs it is about (`run`: space-separated `key=value`s) and a bound,
absolute (`at_least`, `at_most`) or relative to other runs (`vs` with
`ratio_at_least`, `ratio_at_most`, `ratio_below`). Where a sweep has more keys
than a claim names, it is stated once per matching pair, so every comparison
the sweep holds is decided, not only the first. The verdict (lab/stats.py) is
`holds` when the whole 95% interval clears the bound, `fails` when it misses
it, `inconclusive` otherwise; `None` when the runs it names are missing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from servelab.errors import ConfigError
from servelab.lab.estimates import estimate, ratio
from servelab.lab.runs import Configuration, normalize
from servelab.lab.stats import (
    FAILS,
    HOLDS,
    NO_ESTIMATE,
    VERDICT_RULES,
    Estimate,
    interval_text,
    is_counted,
    rounded,
    verdict,
)

CLAIM_OPS = {op: is_ratio for op, (is_ratio, _) in VERDICT_RULES.items()}
SHOWN = {
    "ratio_at_least": "≥ {x:g}×",
    "ratio_at_most": "≤ {x:g}×",
    "ratio_below": "< {x:g}×",
    "at_least": "≥ {x:g}",
    "at_most": "≤ {x:g}",
}


@dataclass
class ClaimResult:
    text: str
    verdict: str | None  # holds | fails | inconclusive; None: the runs it names are missing
    figure: str = ""
    op: str = ""
    bound: float = float("nan")
    estimate: Estimate = NO_ESTIMATE
    # what the claim's plot draws: (label, estimate) per configuration it names
    bars: list[tuple[str, Estimate]] = field(default_factory=list)

    @property
    def holds(self) -> bool | None:
        return None if self.verdict is None else self.verdict == HOLDS


def evaluate_claims(
    configs: Sequence[Configuration], claims: Iterable[Mapping]
) -> list[ClaimResult]:
    return [result for claim in claims for result in evaluate_claim(configs, claim)]


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


def matches(config: Configuration, selector: dict[str, str]) -> bool:
    return all(config.params.get(k) == v for k, v in selector.items())


def evaluate_claim(configs: Sequence[Configuration], claim: Mapping) -> list[ClaimResult]:
    """One claim, stated for every configuration (pair) it matches."""
    claim = dict(claim)
    name, text = claim.pop("figure", None), claim.pop("text", None)
    if claim.pop("same_in_every_run", False):
        return [_same_everywhere(configs, name, text)]
    run_sel, vs_sel = claim.pop("run", None), claim.pop("vs", None)
    ops = [op for op in claim if op in CLAIM_OPS]
    unknown = [k for k in claim if k not in CLAIM_OPS]
    if not name or not run_sel or len(ops) != 1 or unknown:
        raise ConfigError(
            f"report claim {claim!r}: needs figure, run (key=value), optional vs and text, "
            f"and exactly one of {', '.join(CLAIM_OPS)} (or figure + same_in_every_run: true)"
        )
    op = ops[0]
    if CLAIM_OPS[op] and not vs_sel:
        raise ConfigError(f"report claim on {name}: {op} compares two runs; give `vs`")
    bound = float(claim[op])
    run_pairs = parse_selector(run_sel)
    picked = [c for c in configs if matches(c, run_pairs) and c.finished]
    heading = text or f"{name} of {run_sel}"
    if not picked:
        return [ClaimResult(f"{heading} — no run with {run_sel}", None, name, op, bound)]
    stated = SHOWN[op].format(x=bound)
    results = []
    for config in picked:
        value = estimate(config, name)
        if not CLAIM_OPS[op]:
            detail = f"{name} = {rounded(value)} {interval_text(value)} ({config.label})"
            results.append(
                ClaimResult(
                    f"{heading} — {detail} [claim {stated}]",
                    verdict(value, op, bound),
                    name,
                    op,
                    bound,
                    value,
                    [(config.label, value)],
                )  # fmt: skip
            )
            continue
        vs_pairs = parse_selector(vs_sel)
        partner, where = _partner(configs, config, run_pairs, vs_pairs)
        if partner is None:
            results.append(
                ClaimResult(f"{heading} — no run with {vs_sel} to compare", None, name, op, bound)
            )
            continue
        base = estimate(partner, name)
        quotient = ratio(config, partner, name)
        detail = (
            f"{name}: {rounded(value)} ({run_sel}) vs {rounded(base)} ({vs_sel}){where} = "
            f"{rounded(quotient)}× {interval_text(quotient)}"
        )
        results.append(
            ClaimResult(
                f"{heading} — {detail} [claim {stated}]",
                verdict(quotient, op, bound),
                name,
                op,
                bound,
                quotient,
                [(f"{run_sel}{where}", quotient)],
            )  # fmt: skip
        )
    return results


def _partner(configs, config, run_pairs, vs_pairs) -> tuple[Configuration | None, str]:
    """The `vs` configuration that differs from `config` only in what the two
    selectors name, and the shared choices that locate the pair."""
    others = {k: v for k, v in config.swept.items() if k not in run_pairs and k not in vs_pairs}
    for candidate in configs:
        if candidate.finished and matches(candidate, vs_pairs):
            if all(candidate.swept.get(k) == v for k, v in others.items()):
                where = f" at {', '.join(f'{k}={v}' for k, v in others.items())}" if others else ""
                return candidate, where
    return None, ""


def _same_everywhere(configs: Sequence[Configuration], name: str, text: str | None):
    values = {str(run.summary.get(name)) for config in configs for run in config.finished}
    shown = ", ".join(sorted(values))
    same = len(values) == 1 and "None" not in values
    kind = "" if is_counted(name) else " (a timed figure: equal only by chance)"
    return ClaimResult(
        f"{text or name + ' is the same in every run'} — {name}: {shown}{kind}",
        HOLDS if same else FAILS,
        name,
    )
