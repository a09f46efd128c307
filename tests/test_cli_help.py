"""`servelab --help` names every command (a run, a sweep, serve, route, bench serve, the
report and the plugin listing) and says options are key=value; a `--flag` written as another
tool's option (`servelab --model tiny`) is one error line naming the key=value to write."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def servelab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "servelab"), *args], capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_help_names_every_command_and_the_option_form():
    done = servelab("--help")
    assert done.returncode == 0, done.stderr[-2000:]
    head = done.stdout.split("== Configuration groups ==")[0]
    for command in ("servelab -m", "servelab serve", "servelab route", "servelab bench serve",
                    "servelab-report", "servelab-plugins"):  # fmt: skip
        assert command in head, command
    assert "model=tiny" in head and "key=value" in head
    assert "is powered by Hydra" not in done.stdout


@pytest.mark.parametrize(
    "args,written",
    [
        (["--model", "tiny"], "model=tiny"),
        (["--model=tiny"], "model=tiny"),
        (["--engine.max_num_seqs", "8", "workload=synthetic"], "engine.max_num_seqs=8"),
        (["serve", "--model", "tiny"], "model=tiny"),
        (["--max-num-seqs", "8"], "engine.max_num_seqs=8"),  # an engine option, as vLLM spells it
    ],
)
def test_a_flag_is_one_error_naming_the_key_value_to_write(args, written):
    done = servelab(*args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("servelab: error: "), done.stderr
    assert f"write {written}" in lines[0] and "servelab --help" in lines[0]
