"""The docs say what the configs hold: every preset is listed (README and
docs/ablation.md), each repeat count the docs give is the preset's
`run.repeats`, the config-group listing in docs/ablation.md names every option
file of every group, and the README's first examples avoid the Triton
interpreter on a CPU. A preset, part or count changed without its docs fails here."""

from __future__ import annotations

import re
from importlib.resources import files
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
CONF = Path(str(files("servelab.conf")))
README, ABLATION = (ROOT / "README.md").read_text(), (ROOT / "docs" / "ablation.md").read_text()


def presets() -> dict[str, int]:
    """Each preset's name and its run.repeats (1 when it sets none)."""
    found = {}
    for path in sorted((CONF / "experiment").glob("*.yaml")):
        node = OmegaConf.load(path)
        found[path.stem] = int(OmegaConf.select(node, "run.repeats", default=1))
    return found


def options(group: str) -> set[str]:
    return {path.stem for path in (CONF / group).glob("*.yaml")}


def test_every_preset_is_in_the_readme_and_the_guide():
    for name in presets():
        assert f"`{name}`" in README, f"README.md does not list the preset {name}"
        assert f"`{name}`" in ABLATION, f"docs/ablation.md does not list the preset {name}"


def test_the_repeats_the_guide_states_are_the_presets():
    repeats = presets()
    # "servelab -m experiment=NAME   # ..., N repeats" and the table's "| `NAME` | ... (N) |"
    stated = [(m[1], int(m[2])) for m in re.finditer(
        r"servelab -m experiment=(\w+)[^\n]*?# [^\n]*?(\d+) repeats", ABLATION)]  # fmt: skip
    stated += [(m[1], int(m[2])) for m in re.finditer(
        r"^\| `(\w+)` \| [^|]*\((\d+)\) \|", ABLATION, flags=re.MULTILINE)]  # fmt: skip
    assert len(stated) >= len([r for r in repeats.values() if r > 1])
    wrong = [(name, said, repeats[name]) for name, said in stated if repeats[name] != said]
    assert wrong == [], "docs/ablation.md states other repeats than the presets: " + repr(wrong)


def test_the_guide_lists_every_option_of_every_group():
    listing = ABLATION[ABLATION.index("conf/config.yaml        defaults list") :]
    for group in ("model", "scheduler", "allocator", "preemption", "attention", "executor",
                  "kv_tier", "hardware", "workload", "device"):  # fmt: skip
        line = next((ln for ln in listing.splitlines() if ln.startswith(f"conf/{group}/")), None)
        assert line is not None, f"docs/ablation.md lists no conf/{group}/"
        named = set(re.findall(r"[\w.-]+", line.split("/", 2)[2]))
        missing = options(group) - named
        assert not missing, f"docs/ablation.md's conf/{group}/ line leaves out {sorted(missing)}"


def test_the_readme_examples_run_in_seconds_on_a_cpu():
    block = README[README.index("## Pick parts on the command line") :]
    block = block[block.index("```bash") : block.index("```", block.index("```bash") + 7)]
    for line in block.splitlines():
        if line.startswith("servelab ") and "device=cuda" not in line:
            assert "triton_paged" not in line, f"interpreted on a CPU, minutes: {line}"


def test_the_documented_command_line_claim_parses_and_decides():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    line = next(ln for ln in ABLATION.splitlines() if "'report.claims=" in ln)
    override = line[line.index("'") + 1 : line.rindex("'")]
    (parsed,) = OverridesParser.create().parse_overrides([override])
    (claim,) = parsed.value()
    from servelab.lab.claims import CLAIM_OPS, parse_selector

    assert parse_selector(claim["run"]) == {"scheduler": "continuous"}
    assert sum(op in claim for op in CLAIM_OPS) == 1 and override in README
