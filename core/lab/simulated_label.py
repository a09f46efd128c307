"""How a result from the simulated executor names itself. Its times are a cost
model's, on a virtual clock, for a hardware profile and a model shape that no
device ran; read as measurements they mislead. So every table, plot title and
provenance record of such a run carries one label: the executor, the hardware
profile, the model, "virtual time", and the profile's measured accuracy (the
median absolute error of its fit against measured times, as its `sources`
state it), or that it has none (a datasheet profile).

`simulation(provenance, choices)` reads a run's record (results.json's
`provenance` and `choices`); `label` turns it into the one line shown.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

# "median abs error 7.4%", "median abs step error 21.7%", "median abs error by file: all_reduce 5.7%"
ERROR = re.compile(r"median abs (?:step )?error(?: by file: \w+)? (\d+(?:\.\d+)?)%")
# what each `sources` entry of a profile measured
MEASURED = {"fitted": "operators", "measured": "operators", "efficiencies": "steps",
            "interconnect": "all-reduce", "attention": "attention"}  # fmt: skip


def accuracy(hardware: Mapping | None) -> str | None:
    """The profile's measured accuracy, `median abs error 7.4% (operators), 6.3%
    (all-reduce)`; None when its sources state none."""
    found = []
    for key, text in ((hardware or {}).get("sources") or {}).items():
        match = ERROR.search(str(text))
        if match:
            found.append(f"{match.group(1)}% ({MEASURED.get(key, key)})")
    return f"median abs error {', '.join(found)}" if found else None


def simulation(provenance: Mapping | None, choices: Mapping | None = None) -> dict | None:
    """Executor, hardware profile, model and accuracy of a run on a virtual
    clock; None for a run timed by a real clock."""
    executor = (provenance or {}).get("executor") or {}
    if not executor.get("virtual_clock"):
        return None
    choices = choices or {}
    hardware = executor.get("hardware") or {}
    return {
        "executor": str(choices.get("executor") or "simulated"),
        "hardware": str(choices.get("hardware") or hardware.get("name") or "?"),
        "model": str((provenance or {}).get("model") or choices.get("model") or "?"),
        "basis": hardware.get("basis"),
        "accuracy": accuracy(hardware),
    }


def label(found: Mapping) -> str:
    """`simulated: executor=simulated, hardware=h100-sxm, model=llama3-8b, virtual
    time; cost model median abs error 7.4% (operators), ...`."""
    head = (f"simulated: executor={found['executor']}, hardware={found['hardware']}, "
            f"model={found['model']}, virtual time")  # fmt: skip
    if found.get("accuracy"):
        return f"{head}; cost model {found['accuracy']} against measured times"
    basis = f" (profile basis: {found['basis']})" if found.get("basis") else ""
    return f"{head}; cost model accuracy not measured{basis}"


def run_label(run: Any) -> str | None:
    """The label of a report's Run (lab/runs.py), or None for a real one."""
    found = simulation(run.provenance, run.results.get("choices"))
    return label(found) if found else None


def report_note(configs: Sequence[Any]) -> str | None:
    """What a plot of these configurations says of simulation: the label of
    every simulated run, and which configurations they are when not all."""
    labels: dict[str, list[str]] = {}
    for config in configs:
        for run in config.finished:
            text = run_label(run)
            if text and config.label not in labels.setdefault(text, []):
                labels[text].append(config.label)
    if not labels:
        return None
    every = all(run_label(run) for config in configs for run in config.finished)
    parts = [text if every else f"{', '.join(names)}: {text}" for text, names in labels.items()]
    return "\n".join(textwrap.fill(part, 110) for part in parts)
