"""`summary.md`: what a report says in words. Provenance and busy-machine
warnings, the claims with their verdicts, their n and what an indicative one
still needs, how the figures were decided (intervals over repeats, or exact
on a virtual clock, with the simulation's label: executor, hardware profile,
model, virtual time and the cost model's measured accuracy), the capacity
table, every configuration's key figures, the failed runs and the plots."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from servelab.lab.claims import ClaimResult
from servelab.lab.estimates import estimate
from servelab.lab.runs import Configuration, Run
from servelab.lab.simulated_label import run_label
from servelab.lab.stats import INDICATIVE, rounded

VERDICT_MARKS = {
    "holds": "✅ holds",
    "fails": "❌ fails",
    "inconclusive": "❔ inconclusive",
    INDICATIVE: "🔸 indicative",
    None: "⚠️ cannot check",
}


def claim_line(claim: ClaimResult) -> str:
    mark = VERDICT_MARKS[claim.verdict]
    if claim.verdict == INDICATIVE:
        mark += f" (n={claim.estimate.n})"
    return f"- {mark}: {claim.text}"


def claims_intro(settings: Mapping, configs: Sequence[Configuration], claims) -> list[str]:
    """How the claims were decided: on intervals over repeats, or exactly (a
    virtual clock), and what an indicative verdict still needs."""
    finished = [c for c in configs if c.finished]
    if finished and all(c.deterministic for c in finished):
        ran = sorted({executor_text(run) for c in finished for run in c.finished})
        lines = [f"Every run: {'; '.join(ran)}. A virtual clock makes each figure an exact "
                 "function of the config, so one run decides a claim; there are no intervals "
                 "(exact for the cost model, whose accuracy the label states)."]  # fmt: skip
    else:
        lines = [
            "Decided on 95% confidence intervals over the repeats; ratios on the log scale. "
            f"A figure that varies between repeats is decided on at least "
            f"{settings['min_repeats']} repeats (report.min_repeats)."
        ]
    indicative = [c for c in claims if c.verdict == INDICATIVE]
    if indicative:
        more = max(c.more_repeats for c in indicative)
        lines.append(
            f"{len(indicative)} claim(s) are indicative only: run {more} more repeat(s) "
            f"(`run.repeats={settings['min_repeats']}` or more) to decide them."
        )
    return lines + [""]


def executor_text(run: Run) -> str:
    """What timed a run: the simulation's label (lab/simulated_label.py), or the
    executor that ran the model."""
    simulated = run_label(run)
    if simulated:
        return simulated
    return f"executor={(run.results.get('choices') or {}).get('executor', 'model')}"


def markdown(settings, configs, fixed, claims, figures, plots, warnings, capacities) -> str:
    lines = [f"# {settings['title']}", ""]
    if settings.get("given"):
        lines += ["Report options given to servelab-report, over the stored ones: "
                  + ", ".join(f"`{o}`" for o in settings["given"]), ""]  # fmt: skip
    lines += [f"> ⚠️ Warning: {w}." for w in warnings]
    lines += [""] if warnings else []
    if claims:
        lines += ["## Claims", "", *claims_intro(settings, configs, claims)]
        lines += [claim_line(claim) for claim in claims] + [""]
    if capacities:
        lines += capacity_lines(settings["slo"], capacities)
    runs = sum(len(c.runs) for c in configs)
    lines += [f"## Configurations ({len(configs)}, {runs} runs), best {settings['sort']} first", ""]
    finished = [c for c in configs if c.finished]
    if finished and all(c.deterministic for c in finished):
        ran = sorted({executor_text(run) for c in finished for run in c.finished})
        lines.append(f"Every run: {'; '.join(ran)}. On a virtual clock each figure is exact "
                     "for the cost model, a function of the config (no device ran the model); "
                     "its times are the cost model's, not measured.")  # fmt: skip
        fixed = {k: v for k, v in fixed.items() if k != "device"}
    else:
        lines.append(
            "Each figure: mean ± half-width of its 95% interval over the repeats (t for means, "
            "cut at zero where negative values are impossible; bootstrap for percentiles); "
            "*exact*: a counted figure every repeat agrees on."
        )
        simulated = sorted({text for c in finished for run in c.finished
                            if (text := run_label(run))})  # fmt: skip
        if simulated:
            lines.append(f"Configurations marked *(sim)* ran {'; '.join(simulated)}: their "
                         "times are the cost model's, exact, not measured.")  # fmt: skip
    lines.append("")
    if fixed:
        lines += ["Same in every run: " + ", ".join(f"`{k}={v}`" for k, v in fixed.items()), ""]
    every_simulated = bool(finished) and all(c.deterministic for c in finished)
    swept = list(configs[0].swept) if configs else []
    header = ["#", *swept, "runs", *figures]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join("---" for _ in header) + "|")
    for i, config in enumerate(configs, start=1):
        mark = " *(sim)*" if config.deterministic and not every_simulated else ""
        cells = [f"{i}{mark}", *(config.swept.get(k, "") for k in swept), str(len(config.finished))]
        if not config.finished:
            cells += ["failed"] + [""] * (len(figures) - 1)
        else:
            cells += [_figure_cell(config, name) for name in figures]
        lines.append("| " + " | ".join(cells) + " |")
    failed = [(config, run) for config in configs for run in config.runs if run.error]
    if failed:
        lines += ["", f"## Failed runs ({len(failed)})", ""]
        lines += [f"- {c.label} (`{run.folder}`): {run.error}" for c, run in failed]
    lines += ["", "## Plots", ""] + [f"![{name.rsplit('.', 1)[0]}]({name})" for name in plots]
    return "\n".join(lines + [""])


def _cell(value) -> str:
    text = rounded(value)
    return f"{text} *exact*" if value.exact else text


def _figure_cell(config: Configuration, name: str) -> str:
    """A figure's estimate, or a text figure's values (e.g. the requests per replica:
    `8 8 8 8`), each distinct one once."""
    values = [run.summary.get(name) for run in config.finished]
    if values and all(isinstance(v, str) for v in values):
        return "; ".join(dict.fromkeys(values))
    return _cell(estimate(config, name))


def capacity_lines(slo: Mapping, capacities: Sequence[dict]) -> list[str]:
    targets = ", ".join(f"{k} ≤ {v:g}" for k, v in slo.items() if k != "percentile")
    lines = [
        "## Capacity under the SLO",
        "",
        f"SLO: {targets} for {slo['percentile']:g}% of requests. Capacity: the highest "
        "request rate whose mean attainment over the repeats reaches that share.",
        "",
        "| configuration | capacity (req/s) | attainment % by rate |",
        "|---|---|---|",
    ]
    for row in capacities:
        by_rate = ", ".join(f"{r:g}: {p:.0f}" for r, p in row["attainment_by_rate"].items())
        best = row["capacity_rps"]
        lines.append(
            f"| {row['configuration']} | "
            f"{'below the lowest rate' if best is None else f'{best:g}'} | {by_rate} |"
        )
    return lines + [""]
