"""A broken third-party plugin hurts only itself: with each broken fake
distribution installed, `LLM()`, `servelab-plugins` and the default `servelab`
run all succeed, and each prints one warning that names the broken plugin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FAKE_DISTS = Path(__file__).parent / "fake_dists"
# fake distribution folders installed together -> the entry point the warning must name
BROKEN = {
    "misspelled-hook": (["typo"], "fake_typo"),
    "duplicate-name": (["sjf", "dup"], "fake_dup (servelab-fake-dup 2.0.0)"),
    "missing-abstract-methods": (["incomplete"], "fake_incomplete"),
    "fails-to-import": (["broken"], "fake_broken (servelab-fake-broken 0.0.1)"),
}
COMMANDS = {
    "LLM": [sys.executable, "-c", "from servelab import LLM; LLM().generate([[5, 6, 7]])"],
    "servelab-plugins": [sys.executable, "-c", "from servelab.registry.listing import main; main([])"],
    "servelab": [
        sys.executable, "-c", "from servelab.cli import main; main()",
        "hydra.run.dir={tmp}", "run.progress=false", "workload.scale=0.1",
    ],
}  # fmt: skip


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_plugin_is_one_warning_and_everything_else_works(tmp_path, case, command):
    folders, culprit = BROKEN[case]
    env = dict(os.environ)
    paths = [str(FAKE_DISTS / f) for f in folders]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    argv = [a.format(tmp=tmp_path) for a in COMMANDS[command]]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    warnings = [line for line in output.splitlines() if "servelab plugin failed" in line]
    assert len(warnings) == 1, output[-3000:]
    assert culprit in warnings[0]
    assert "Traceback" not in output
