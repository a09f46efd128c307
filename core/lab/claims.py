"""A preset's claims, decided on its configurations' intervals. A claim names a
figure, the runs it is about (`run`: space-separated `key=value`s) and a bound,
absolute (`at_least`, `at_most`) or relative to other runs (`vs` with
`ratio_at_least`, `ratio_at_most`, `ratio_below`). Where a sweep has more keys
than a claim names, it is stated once per matching pair, so every comparison
the sweep holds is decided, not only the first. The verdict (lab/stats.py) is
`holds` when the whole 95% interval clears the bound, `fails` when it misses
it, `inconclusive` otherwise; `None` when the runs it names are missing. A
timed figure (not exact) on fewer than `min_repeats` repeats is `indicative`:
shown with its n and how many more repeats would let it be decided. Every
claim line states its n.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from servelab.errors import ConfigError
from servelab.lab.estimates import estimate, paired_repeats, ratio
from servelab.lab.runs import Configuration, normalize
from servelab.lab.stats import (
    FAILS,
    HOLDS,
    INDICATIVE,
    MIN_REPEATS,
    NO_ESTIMATE,
    VERDICT_RULES,
    Estimate,
    interval_text,
    is_counted,
    point_text,
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
    verdict: str | None  # holds | fails | inconclusive | indicative; None: runs missing
    figure: str = ""
    op: str = ""
    bound: float = float("nan")
    estimate: Estimate = NO_ESTIMATE
    # what the claim's plot draws: (label, estimate) per configuration it names
    bars: list[tuple[str, Estimate]] = field(default_factory=list)
    min_repeats: int = MIN_REPEATS

    @property
    def more_repeats(self) -> int:
        """Repeats still missing before an indicative claim can be decided."""
        if self.verdict != INDICATIVE:
            return 0
        return max(0, self.min_repeats - self.estimate.n)

    @property
    def holds(self) -> bool | None:
        return None if self.verdict is None else self.verdict == HOLDS


def evaluate_claims(
    configs: Sequence[Configuration], claims: Iterable[Mapping], min_repeats: int = MIN_REPEATS
) -> list[ClaimResult]:
    return [
        result for claim in claims for result in evaluate_claim(configs, claim, min_repeats)
    ]


def sample_text(value: Estimate, paired: bool = False) -> str:
    """`n=8 paired repeats`, `exact, n=1`: what an interval rests on."""
    if value.exact:  # the interval's text already says exact
        return f"n={value.n}"
    return f"n={value.n}{' paired' if paired else ''} repeat{'s' if value.n != 1 else ''}"


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


def evaluate_claim(
    configs: Sequence[Configuration], claim: Mapping, min_repeats: int = MIN_REPEATS
) -> list[ClaimResult]:
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
            detail = (
                f"{name} = {point_text(value)} {interval_text(value)} ({config.label}; "
                f"{sample_text(value)})"
            )
            results.append(
                ClaimResult(
                    f"{heading} — {detail} [claim {stated}]",
                    verdict(value, op, bound, min_repeats),
                    name,
                    op,
                    bound,
                    value,
                    [(config.label, value)],
                    min_repeats,
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
            f"{name}: {point_text(value)} ({run_sel}) vs {point_text(base)} ({vs_sel}){where} = "
            f"{point_text(quotient)}× {interval_text(quotient)} "
            f"({sample_text(quotient, paired_repeats(config, partner))})"
        )
        results.append(
            ClaimResult(
                f"{heading} — {detail} [claim {stated}]",
                verdict(quotient, op, bound, min_repeats),
                name,
                op,
                bound,
                quotient,
                [(f"{run_sel} vs {vs_sel}{where}", quotient)],
                min_repeats,
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
