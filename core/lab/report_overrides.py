"""Report options from `servelab-report`'s command line: `report.KEY=VALUE`
arguments, in Hydra's override syntax, merged into the `report:` node stored
with the runs, so a claim, an SLO or a plot option changes without running the
sweep again (`servelab-report DIR report.slo.ttft_ms=200 report.time_axis=seconds`).

A key is set the way `servelab` sets it: `report.slo.ttft_ms=200` sets one key
of the SLO, `'report.slo={ttft_ms: 200}'` replaces the whole node, `~report.slo`
removes it, `+`/`++` are accepted. Only keys of the report node are options
here; a run's other keys (`scheduler=...`) are what the runs measured, fixed.
An unknown key is a ConfigError naming the valid ones; values are checked by
`report_options` as the stored ones are.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence

from servelab.errors import ConfigError
from servelab.lab.slo import SLO_KEYS

NESTED = {"slo": SLO_KEYS}  # the report options that are nodes of their own


def is_override(arg: str) -> bool:
    """Whether a `servelab-report` argument is an option rather than a path."""
    return "=" in arg or arg.startswith("~")


def apply_overrides(
    stored: Mapping | None, overrides: Sequence[str], accepted: Iterable[str]
) -> dict:
    """The stored `report:` node with `overrides` applied (a copy); `accepted`:
    the report's option names (lab/report.py's REPORT_DEFAULTS)."""
    accepted = list(accepted)
    node = copy.deepcopy(dict(stored or {}))
    for override in parse(overrides):
        parts = override.key_or_group.split(".")
        text = override.input_line
        if parts[0] != "report" or len(parts) < 2:
            raise ConfigError(
                f"servelab-report takes report options as report.KEY=VALUE "
                f"(report.time_axis=seconds, report.slo.ttft_ms=200); got {text!r}"
            )
        key = parts[1]
        if key not in accepted:
            raise ConfigError(
                f"unknown report option {key!r}; accepted: {', '.join(sorted(accepted))}"
            )
        if override.is_sweep_override():
            raise ConfigError(f"{text!r}: a report option takes one value each, not a sweep")
        value = None if override.is_delete() else override.value()
        if len(parts) == 2:
            node[key] = value
            continue
        inner = NESTED.get(key)
        if inner is None or len(parts) > 3:
            raise ConfigError(f"report option {key} has no keys of its own; got {text!r}")
        if parts[2] not in inner:
            raise ConfigError(
                f"unknown report.{key} option {parts[2]!r}; accepted: {', '.join(sorted(inner))}"
            )
        node[key] = {**(node.get(key) or {}), parts[2]: value}
    return node


def parse(overrides: Sequence[str]) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    found = []
    for text in overrides:
        try:
            found += parser.parse_overrides([text])
        except HydraException as err:
            reason = str(err).splitlines()[0]
            raise ConfigError(f"cannot read {text!r} as report.KEY=VALUE: {reason}") from None
    return found
